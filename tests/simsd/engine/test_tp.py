"""Tensor-parallel target on CPU (gloo): the sharded model and TP decoding equal the unsharded ones."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simsd import DecodeConfig, load_checkpoint, vanilla_generate
from simsd.engine.tp import check_tp, shard_model, spawn
from simsd.speculative import SpecConfig, speculative_generate
from tests.helpers import random_checkpoint

V = 96
ROOT = Path(__file__).resolve().parents[3]


def ckpt_path(name="tp-target", layers=2, seed=0):
    return random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2,
                             intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def _rank(path, draft_path, out):
    import torch.distributed as dist

    from simsd.engine.tp import shard_model, shutdown
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = load_checkpoint(path, dtype="float64", with_tokenizer=False)
    t.model.attention_backend = "torch"
    shard_model(t.model, rank, world)
    d = load_checkpoint(draft_path, dtype="float64", with_tokenizer=False)
    d.model.attention_backend = "torch"
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)
    res = {"vanilla": vanilla_generate(t.model, list(range(1, 11)), cfg, t.mask_token_id, []).token_ids,
           "exact": speculative_generate(t, d, list(range(1, 11)), cfg, SpecConfig(mode="exact")).token_ids,
           "kv_heads": t.model.new_cache(1, 4).k[0].shape[2]}
    from simsd import LLM, SamplingParams  # the Python API over the ranks: each rank shards its own target
    llm = LLM(str(path), str(draft_path), "exact", tp=world, dtype="float64", device="cpu", attention_backend="torch",
              batch_size=2)
    assert llm.target.model.tp == (rank, world) and not llm.scheduler_thread
    outs = llm.generate([list(range(1, 11)), list(range(3, 9))], SamplingParams(max_tokens=12))
    res["api_exact"] = outs[0].token_ids
    res["api_second"] = outs[1].token_ids
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    shutdown()


def test_tp2_decoding_equals_single_process(tmp_path):
    path, draft = ckpt_path(), ckpt_path("tp-draft", layers=1, seed=3)
    t = load_checkpoint(path, dtype="float64", with_tokenizer=False)
    d = load_checkpoint(draft, dtype="float64", with_tokenizer=False)
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)
    want = {"vanilla": vanilla_generate(t.model, list(range(1, 11)), cfg, t.mask_token_id, []).token_ids,
            "exact": speculative_generate(t, d, list(range(1, 11)), cfg, SpecConfig(mode="exact")).token_ids}
    want["api_exact"] = want["exact"]
    want["api_second"] = speculative_generate(t, d, list(range(3, 9)), cfg, SpecConfig(mode="exact")).token_ids
    spawn(_rank, 2, str(path), str(draft), str(tmp_path / "res"))
    for rank in range(2):
        got = json.loads((tmp_path / f"res.{rank}").read_text())
        assert got["kv_heads"] == 1  # each rank caches its own kv head
        assert {k: got[k] for k in want} == want


def test_cli_tp2_spawns_ranks():
    path = ckpt_path()
    common = [sys.executable, "-m", "simsd.entrypoints.cli", "generate", "--target", str(path),
              "--prompt-ids", "5,6,7,8,9",
              "--max-new-tokens", "8", "--json", "--device", "cpu", "--attention-backend", "torch"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    two = subprocess.run(common + ["--tp", "2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert len(two.stdout.splitlines()) == 1  # rank 0 prints, rank 1 does not
    loading = [line for line in two.stderr.splitlines() if line.startswith("simsd: loading")]
    assert len(loading) == 1 and loading[0].endswith("per rank, the target tensor-parallel over 2 ranks"), two.stderr
    t = load_checkpoint(path, dtype="float32", with_tokenizer=False)
    t.model.attention_backend = "torch"
    want = vanilla_generate(t.model, [5, 6, 7, 8, 9], DecodeConfig(max_new_tokens=8), t.mask_token_id, t.stop_ids)
    assert json.loads(two.stdout)["token_ids"] == want.token_ids


@pytest.mark.parametrize("field,value", [("intermediate_size", 129), ("num_key_value_heads", 1)])
def test_tp_refuses_a_sharded_dimension_that_does_not_divide(field, value):
    """``--tp 2`` on an odd MLP width or an odd number of KV heads is refused by name (a shard of
    ``n // 2`` would silently drop a channel or a head): by the check, by ``shard_model`` (the
    model left whole) and by the command line before any rank starts (exit 2, one line; run
    once). The query heads are a multiple of the KV heads, so their own check cannot fail
    alone. The even neighbours shard."""
    shape = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    shape[field] = value
    path = random_checkpoint(f"tp-odd-{field}", tokenizer=False, vocab_size=V, num_hidden_layers=1, std=0.2,
                             **shape)
    t = load_checkpoint(path, dtype="float32", with_tokenizer=False)
    assert getattr(t.config, field) == value
    message = f"--tp 2: {field} = {value} is not a multiple of 2"
    with pytest.raises(ValueError, match=message):
        check_tp(t.config, 2)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        shard_model(t.model, 0, 2)
    after = t.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    check_tp(t.config, 1)  # one rank takes any shape
    check_tp(load_checkpoint(ckpt_path(), dtype="float32", with_tokenizer=False).config, 2)
    if field != "intermediate_size":  # the command line runs the same check: once is enough
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "simsd.entrypoints.cli", "generate", "--target", str(path),
                           "--prompt-ids", "5,6,7", "--device", "cpu", "--tp", "2"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"simsd: error: {message}"], proc.stderr


def test_nccl_init_names_the_rank_device(monkeypatch):
    """``init_from_env("cuda")`` makes the rank's GPU current and passes it as ``device_id``, so
    NCCL initialises eagerly on it (checked without a GPU: the calls are recorded)."""
    import simsd.engine.tp as tp
    calls = []
    monkeypatch.setattr(tp.torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(tp.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    tp.init_from_env("cuda")
    assert calls == [("set_device", torch.device("cuda", 1)), ("nccl", {"device_id": torch.device("cuda", 1)})]
    calls.clear()
    tp.init_from_env("cpu")
    assert calls == [("gloo", {})]


def test_cli_tp2_refusal_is_one_line_exit_2():
    """A prompt every rank refuses: exit 2 and rank 0's one line, not one per rank nor the
    launcher's own messages."""
    path = ckpt_path()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "simsd.entrypoints.cli", "generate", "--target", str(path),
                           "--prompt-ids", "5,6,999999", "--device", "cpu", "--tp", "2"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("simsd: loading")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("simsd: error: --prompt-ids: token id 999999 is outside the vocabulary"), proc.stderr
