"""Tensor-parallel target on CPU (gloo): the sharded model and TP decoding equal the unsharded ones."""
import dataclasses
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


def _join_and_load(path, draft_path):
    """In a spawned rank: join the gloo group; ``(rank, world, sharded float64 target, draft)``."""
    import torch.distributed as dist

    from simsd.engine.tp import shard_model
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = load_checkpoint(path, dtype="float64", with_tokenizer=False)
    t.model.attention_backend = "torch"
    shard_model(t.model, rank, world)
    d = load_checkpoint(draft_path, dtype="float64", with_tokenizer=False)
    d.model.attention_backend = "torch"
    return rank, world, t, d


def _rank(path, draft_path, out):
    from simsd.engine.tp import shutdown
    rank, world, t, d = _join_and_load(path, draft_path)
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)
    res = {"vanilla": vanilla_generate(t.model, list(range(1, 11)), cfg, t.mask_token_id, []).token_ids,
           "exact": speculative_generate(t, d, list(range(1, 11)), cfg, SpecConfig(mode="exact")).token_ids,
           "self": speculative_generate(t, "self", list(range(1, 11)), cfg, SpecConfig(mode="exact")).token_ids,
           "kv_heads": t.model.new_cache(1, 4).k[0].shape[2]}
    from simsd import LLM, SamplingParams  # the Python API over the ranks: each rank shards its own target
    llm = LLM(str(path), str(draft_path), "exact", tp=world, dtype="float64", device="cpu", attention_backend="torch",
              batch_size=2)
    assert llm.target.model.tp == (rank, world) and not llm.scheduler_thread
    outs = llm.generate([list(range(1, 11)), list(range(3, 9))], SamplingParams(max_tokens=12))
    res["api_exact"] = outs[0].token_ids
    res["api_second"] = outs[1].token_ids
    # self-speculation with the auto width: the ranks' trees depend on the tokens only (no timings)
    llm = LLM(str(path), "self", "exact", tp=world, dtype="float64", device="cpu", attention_backend="torch",
              batch_size=2)
    res["api_self"] = llm.generate([list(range(1, 11))], SamplingParams(max_tokens=12))[0].token_ids
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    shutdown()


def test_tp2_decoding_equals_single_process(tmp_path):
    path, draft = ckpt_path(), ckpt_path("tp-draft", layers=1, seed=3)
    t = load_checkpoint(path, dtype="float64", with_tokenizer=False)
    d = load_checkpoint(draft, dtype="float64", with_tokenizer=False)
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)
    want = {"vanilla": vanilla_generate(t.model, list(range(1, 11)), cfg, t.mask_token_id, []).token_ids,
            "exact": speculative_generate(t, d, list(range(1, 11)), cfg, SpecConfig(mode="exact")).token_ids}
    want["api_exact"] = want["self"] = want["api_self"] = want["exact"]
    assert want["exact"] == want["vanilla"]
    want["api_second"] = speculative_generate(t, d, list(range(3, 9)), cfg, SpecConfig(mode="exact")).token_ids
    spawn(_rank, 2, str(path), str(draft), str(tmp_path / "res"))
    for rank in range(2):
        got = json.loads((tmp_path / f"res.{rank}").read_text())
        assert got["kv_heads"] == 1  # each rank caches its own kv head
        assert {k: got[k] for k in want} == want


MOE = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32), ("mlp_only_layers", (1,)))


def moe_ckpt_path():
    """A MoE target whose layer 0 is sparse and layer 1 dense (both shard paths)."""
    return random_checkpoint("tp-moe", tokenizer=False, vocab_size=V, num_hidden_layers=2, seed=2, std=0.2,
                             intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, moe=MOE)


def _moe_logits_and_tokens(model, prompt):
    from simsd.models.model import labels_for
    L = len(prompt)
    pos = torch.arange(L)[None]
    logits = model(torch.tensor([prompt]), pos, labels_for(L, "cpu", grp=pos // 4), "block_causal",
                   model.new_cache(1, L))
    return logits[0].tolist()


def _moe_rank(path, draft_path, out):
    from simsd.engine.tp import shutdown
    rank, world, t, d = _join_and_load(path, draft_path)
    experts = t.model.model.layers[0].mlp.inner.experts
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)
    res = {"logits": _moe_logits_and_tokens(t.model, list(range(1, 14))),
           "vanilla": vanilla_generate(t.model, list(range(1, 11)), cfg, t.mask_token_id, []).token_ids,
           "exact": speculative_generate(t, d, list(range(1, 11)), cfg, SpecConfig(mode="exact")).token_ids,
           "expert_shapes": [list(experts.gate_up_proj.shape), list(experts.down_proj.shape)]}
    Path(f"{out}.{rank}").write_text(json.dumps(res))
    shutdown()


def test_tp2_moe_equals_single_process(tmp_path):
    """Each rank holds half of every expert's channels (and of the dense layer's); logits equal
    the unsharded model's to float64 rounding, and the tokens of vanilla and exact decoding are
    the same."""
    path, draft = moe_ckpt_path(), ckpt_path("tp-draft", layers=1, seed=3)
    t = load_checkpoint(path, dtype="float64", with_tokenizer=False)
    d = load_checkpoint(draft, dtype="float64", with_tokenizer=False)
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)
    logits = torch.tensor(_moe_logits_and_tokens(t.model, list(range(1, 14))), dtype=torch.float64)
    want = {"vanilla": vanilla_generate(t.model, list(range(1, 11)), cfg, t.mask_token_id, []).token_ids,
            "exact": speculative_generate(t, d, list(range(1, 11)), cfg, SpecConfig(mode="exact")).token_ids}
    spawn(_moe_rank, 2, str(path), str(draft), str(tmp_path / "res"))
    for rank in range(2):
        got = json.loads((tmp_path / f"res.{rank}").read_text())
        assert got["expert_shapes"] == [[8, 32, 64], [8, 64, 16]]
        err = (torch.tensor(got["logits"], dtype=torch.float64) - logits).abs().max().item()
        assert err < 1e-10, err
        assert {k: got[k] for k in want} == want


def test_moe_expert_shards_sum_to_the_whole_block():
    """In one process: the two halves of every expert's channels, each run as a rank would,
    sum to the unsharded block's output (what the all-reduce adds)."""
    import copy

    from simsd.engine.tp import _shard_experts
    from simsd.models.moe import SparseMoeBlock
    t = load_checkpoint(moe_ckpt_path(), dtype="float64", with_tokenizer=False)
    block = t.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(2, 11, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    halves = []
    for rank in range(2):
        part = copy.deepcopy(block)
        _shard_experts(part.experts, rank, 2)
        halves.append(part(x))
    torch.testing.assert_close(halves[0] + halves[1], block(x), rtol=0, atol=1e-12)
    assert (halves[0] - block(x)).abs().max() > 1e-3  # a half alone is not the whole


def test_tp_refuses_odd_expert_channels():
    cfg = dataclasses.replace(load_checkpoint(moe_ckpt_path(), with_tokenizer=False).config, moe_intermediate_size=33)
    with pytest.raises(ValueError, match="--tp 2: moe_intermediate_size = 33 is not a multiple of 2"):
        check_tp(cfg, 2)
    check_tp(dataclasses.replace(cfg, num_experts=0), 2)  # a dense config does not use the field


def test_cli_tp2_spawns_ranks():
    path = ckpt_path()
    common = [sys.executable, "-m", "simsd.entrypoints.cli", "generate", "--mode", "vanilla", "--target", str(path),
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


def test_torchrun_two_nodes_equal_one_process(tmp_path):
    """Multi-node TP as docs/scaling.md launches it, on one machine: two ``torchrun --nnodes 2
    --nproc-per-node 1 --node-rank {0,1}`` launches over loopback (gloo), rendezvous at
    127.0.0.1, each joining the group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` ...). Sampled exact mode with the bundled pair, 3 prompts in rows of 2:
    node 0's JSON lines equal one process's (timings aside); node 1 prints nothing."""
    from simsd.engine.tp import free_port
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Hello", "Why is the sky blue?", "2+2=")))
    command = ["-m", "simsd.entrypoints.cli", "generate", "--mode", "exact", "--prompts-file", str(prompts),
               "--json", "--max-tokens", "16", "--temperature", "0.8", "--seed", "3", "--batch-size", "2",
               "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *command, "--tp", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for rank in range(2)]
    one = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    outs = [node.communicate(timeout=300) for node in nodes]
    assert one.returncode == 0 and [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "the target tensor-parallel over 2 ranks" in outs[0][1]
    timings = ("decode_seconds", "tokens_per_second", "queue_seconds", "time_to_first_token")

    def rows(text):
        out = [json.loads(line) for line in text.splitlines()]
        for row in out:
            row["stats"] = {k: v for k, v in row["stats"].items() if k not in timings}
        return out
    assert len(rows(one.stdout)) == 3 and rows(outs[0][0]) == rows(one.stdout)
    assert outs[1][0] == ""
