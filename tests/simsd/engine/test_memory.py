"""The memory estimate (simsd.engine.memory) against what is allocated, and the refusals of a
run that would not fit, before anything is allocated."""
import json

import pytest
import torch

import simsd.engine.memory as memory
from simsd import DecodeConfig, load_checkpoint, vanilla_generate
from simsd.engine.batching import BatchEngine
from simsd.engine.threads import SMALL_MODEL_PARAMS, choose_threads, default_threads
from simsd.entrypoints.cli import main
from simsd.models.config import ModelConfig
from simsd.models.model import SDARForCausalLM
from simsd.testing import config_dict, moe_config_dict
from tests.helpers import random_checkpoint


@pytest.mark.parametrize("moe", [None, dict(mlp_only_layers=[1]), dict(decoder_sparse_step=1)])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_the_parameters(tie, dtype, moe):
    raw = config_dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, tie_word_embeddings=tie, mask_token_id=96)
    cfg = ModelConfig.from_dict(raw if moe is None else moe_config_dict(raw, **moe))
    model = SDARForCausalLM(cfg).to(dtype)
    assert (moe is None) == (cfg.num_experts == 0)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # shared ones once
    assert memory.weight_bytes(cfg, dtype) == sum(params.values())


def test_a_30b_a3b_shaped_config_has_30_5b_parameters():
    """Qwen3-30B-A3B's published shape (SDAR-30B-A3B's): 30.5B parameters in all, 61 GB in bfloat16;
    the experts are most of them, so a dense-only count would be off by 29B."""
    raw = moe_config_dict(config_dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                      num_attention_heads=32, num_key_value_heads=4, head_dim=128),
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    n = memory.parameter_count(ModelConfig.from_dict(raw))
    assert 30.4e9 < n < 30.6e9, n
    assert memory.weight_bytes(ModelConfig.from_dict(raw), torch.bfloat16) == 2 * n
    work = memory.workspace_bytes(ModelConfig.from_dict(raw), torch.bfloat16, 4, 24, 1000, dense_attention=False)
    assert work >= 4 * 24 * 8 * 3 * 768 * 2  # at least the 8 chosen experts' activations of every token


def test_kv_cache_bytes_are_what_the_engine_allocates():
    c = load_checkpoint(random_checkpoint("mem", tokenizer=False, vocab_size=64), with_tokenizer=False)
    engine = BatchEngine({"target": c.model, "draft": c.model}, 4, 3, capacity=40, margin=24)
    got = sum(t.numel() * t.element_size() for cache in engine.caches.values() for t in cache.k + cache.v)
    want = 2 * memory.kv_cache_bytes(c.config, c.model.dtype, 3, 64)
    assert got == want
    est = memory.estimate({"t": (c.config, c.model.dtype, "cpu", True), "d": (c.config, c.model.dtype, "cpu", True)},
                          3, 40, 24, with_weights=False)
    assert est.parts["cpu"]["kv_caches"] == want and est.parts["cpu"]["weights"] == 0


def test_workspace_grows_with_the_dense_reference():
    cfg = ModelConfig.from_dict(config_dict(vocab_size=97, mask_token_id=96))
    fused = memory.workspace_bytes(cfg, torch.float32, 2, 24, 1000, dense_attention=False)
    dense = memory.workspace_bytes(cfg, torch.float32, 2, 24, 1000, dense_attention=True)
    assert dense - fused >= 2 * 4 * 24 * 1000 * 4  # at least the float scores


@pytest.mark.parametrize("n,text", [(0, "0 bytes"), (1023, "1023 bytes"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
                                    (3 << 20, "3.00 MiB"), ((150 << 20) + 1, "150 MiB"), (8 << 30, "8.00 GiB"),
                                    (int(2.5 * (1 << 30)), "2.50 GiB"), (200 << 30, "200 GiB")])
def test_byte_amounts_read_in_a_unit_that_shows_them(n, text):
    """A small limit never reads as 0.00 GiB (issue 21): the largest unit the amount reaches."""
    assert memory.fmt_bytes(n) == text


def test_engine_refuses_what_does_not_fit(monkeypatch):
    c = load_checkpoint(random_checkpoint("mem", tokenizer=False, vocab_size=64), with_tokenizer=False)
    monkeypatch.setattr(memory, "RESERVE_BYTES", 0)  # the caches alone decide (they grow linearly with rows)
    one_row = memory.estimate({"t": (c.config, c.model.dtype, "cpu", True)}, 1, 64, 8, with_weights=False)
    need_one = one_row.needed("cpu")
    monkeypatch.setattr(memory, "available_bytes", lambda device: int(need_one * 2.5))
    with pytest.raises(ValueError, match="the largest batch size that fits is 2") as exc:
        BatchEngine({"target": c.model}, 4, 8, capacity=64, margin=8)
    assert "\n" not in str(exc.value) and " MiB are free" in str(exc.value) and " 0.00 " not in str(exc.value)
    BatchEngine({"target": c.model}, 4, 2, capacity=64, margin=8)  # fits
    with pytest.raises(ValueError, match="are free"):  # the API path refuses too, before allocating
        vanilla_generate(c.model, [[5, 6]][0], DecodeConfig(max_new_tokens=2000), c.mask_token_id, [])


def test_a_run_that_needs_exactly_the_free_memory_fits(monkeypatch):
    """The boundary of the check: free memory equal to the estimate (margin and reserve
    included) fits, one byte less does not."""
    c = load_checkpoint(random_checkpoint("mem", tokenizer=False, vocab_size=64), with_tokenizer=False)
    need = memory.estimate({"t": (c.config, c.model.dtype, "cpu", True)}, 2, 64, 8, with_weights=False).needed("cpu")
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)
    BatchEngine({"target": c.model}, 4, 2, capacity=64, margin=8)
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    free = memory.fmt_bytes(need - 1)
    with pytest.raises(ValueError, match=f"{free} are free; the largest batch size that fits is 1"):
        BatchEngine({"target": c.model}, 4, 2, capacity=64, margin=8)


@pytest.fixture(scope="module")
def long_ck():
    return str(random_checkpoint("mem-long", tokenizer=False, vocab_size=64, max_position_embeddings=32768))


def test_cli_refuses_a_run_that_cannot_fit_before_loading(long_ck, capsys, monkeypatch):
    """15.10: exact mode with a block length of 4000 needs a (gamma + 2) x B cache margin and a
    verify forward of gamma x B query tokens; refused with the estimate and what would fit."""
    import simsd.entrypoints.builder as api
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(api, "load_checkpoint", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    code = main(["generate", "--target", long_ck, "--draft", long_ck, "--mode", "exact", "--block-length", "4000",
                 "--prompt-ids", ",".join(["5"] * 168), "--max-new-tokens", "64"])
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and "loading" not in err
    assert line.startswith("simsd: error: this run needs about ") and "8.00 GiB are free" in line
    assert "KV caches" in line and "it fits with --block-length " in line
    best = int(line.split("--block-length ")[1].split()[0])
    assert 1 <= best < 4000
    # the suggested block length does fit (and one more does not)
    from simsd.engine.memory import shortfall
    from simsd.entrypoints.resources import RunShape, run_estimate
    from simsd.entrypoints.run_modes import RUN_MODES
    cfg = ModelConfig.from_dir(long_ck)
    shape = RunShape({"target": (cfg, "float32", "cpu", True), "draft": (cfg, "float32", "cpu", True)}, [168], 64,
                     4000, None, 1, [RUN_MODES["exact"]])
    assert shortfall(run_estimate(shape, block_length=best)) is None
    assert shortfall(run_estimate(shape, block_length=best + 1)) is not None


def test_bench_refuses_too_large_batches(long_ck, capsys, monkeypatch, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [5] * 100}) for _ in range(64)))
    monkeypatch.setattr(memory, "available_bytes", lambda device: 600 << 20)
    code = main(["bench", "--target", long_ck, "--modes", "vanilla", "--prompts-file", str(f), "--batch-size", "64",
                 "--max-new-tokens", "8000"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "it fits with" in line and "--batch-size " in line and "--max-new-tokens " in line


# -- CPU threads -------------------------------------------------------------------------------
def test_thread_choice(monkeypatch):
    small = ModelConfig.from_dir(random_checkpoint("mem", tokenizer=False, vocab_size=64))
    big = ModelConfig.from_dict(config_dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                            head_dim=128, mask_token_id=5))
    assert memory.parameter_count(big) > SMALL_MODEL_PARAMS > memory.parameter_count(small)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads([small]) == 1 and choose_threads([small]) == (1, "model size")
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert default_threads([small, big]) == 6
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads([small]) == (3, "OMP_NUM_THREADS")
    assert choose_threads([small], 2) == (2, "--threads")


def test_threads_option_sets_torch(capsys, monkeypatch):
    before = torch.get_num_threads()
    try:
        code = main(["generate", "--prompt-ids", "5,6", "--max-new-tokens", "4", "--threads", "2"])
        assert code == 0 and torch.get_num_threads() == 2
        assert "2 CPU threads" in capsys.readouterr().err
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        code = main(["generate", "--prompt-ids", "5,6", "--max-new-tokens", "4"])  # the bundled pair: one thread
        assert code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# -- the LLM and simsd serve: refused before any weight loads ----------------------------------
def _no_loading(monkeypatch):
    import simsd.entrypoints.builder as api
    monkeypatch.setattr(api, "load_checkpoint", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))


def test_llm_refuses_weights_that_do_not_fit_before_loading(monkeypatch):
    """Issue 34: a checkpoint whose weights exceed the free memory is refused by ``LLM`` in one
    line naming the weights, before any load (on a CPU the OOM killer ends a process that tries,
    with no message)."""
    from simsd import LLM
    from simsd.assets import DEFAULT_TARGET
    from simsd.entrypoints.errors import ParamError
    weights = memory.weight_bytes(ModelConfig.from_dir(DEFAULT_TARGET), "float32")
    monkeypatch.setattr(memory, "available_bytes", lambda device: weights // 2)
    _no_loading(monkeypatch)
    with pytest.raises(ParamError, match=r"^the models and the engine need about .* \(weights ") as exc:
        LLM(None, mode="vanilla", batch_size=1, max_model_len=64)
    assert "\n" not in str(exc.value) and "no smaller batch size or max_model_len fits" in str(exc.value)
    assert memory.fmt_bytes(weights) in str(exc.value)


def _engine_need(path, **settings) -> int:
    """Bytes (margin and reserve included) an LLM of ``settings`` needs, as its check computes them."""
    from simsd.config.engine import EngineArgs
    from simsd.entrypoints.builder import check_engine
    from simsd.entrypoints.resources import engine_size, llm_estimate
    config, infos = check_engine(EngineArgs(target=path, **settings))
    return llm_estimate(config, infos, engine_size(config, infos)).needed("cpu")


@pytest.mark.parametrize("free", ["600 MiB", "8 rows x 24000"])
def test_llm_suggests_the_rows_and_positions_that_fit(long_ck, monkeypatch, free):
    """The engine of 8 rows x 32768 positions does not fit the free memory (600 MiB, or exactly
    what 8 rows of 24000 positions need): the refusal names a batch size and a max_model_len that
    fit (each alone), the largest ones: the LLM builds with either, and not with one more."""
    from simsd import LLM
    free = 600 << 20 if free == "600 MiB" else _engine_need(long_ck, mode="vanilla", batch_size=8,
                                                             max_model_len=24000)
    monkeypatch.setattr(memory, "available_bytes", lambda device: free)
    with pytest.raises(ValueError, match="it fits with batch_size ") as exc:
        LLM(long_ck, mode="vanilla", batch_size=8)
    msg = str(exc.value)
    rows = int(msg.split("batch_size ")[-1].split()[0])
    length = int(msg.split("max_model_len ")[-1].split()[0])
    assert 1 <= rows < 8 and 4 < length < 32768, msg
    if free != 600 << 20:
        assert length >= 24000, msg
    for kw in (dict(batch_size=rows), dict(batch_size=8, max_model_len=length)):
        LLM(long_ck, mode="vanilla", scheduler_thread=False, **kw).shutdown()
    for kw in (dict(batch_size=rows + 1), dict(batch_size=8, max_model_len=length + 1)):
        with pytest.raises(ValueError, match="are free"):  # one more of either does not fit
            LLM(long_ck, mode="vanilla", **kw)


def test_serve_refuses_a_checkpoint_that_cannot_fit_before_loading(capsys, monkeypatch):
    """``simsd serve`` says it in one line and exits 2 (it loaded until the OOM killer came)."""
    from simsd.assets import DEFAULT_TARGET
    weights = memory.weight_bytes(ModelConfig.from_dir(DEFAULT_TARGET), "float32")
    monkeypatch.setattr(memory, "available_bytes", lambda device: weights // 2)
    _no_loading(monkeypatch)
    code = main(["serve", "--mode", "vanilla", "--port", "0"])
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert code == 2 and "loading" not in err, err
    assert line.startswith("simsd: error: the models and the engine need about ") and " are free" in line, line
