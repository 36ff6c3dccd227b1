"""CUDA-graph replay is token-identical to eager decoding with the same shapes (GPU only).

Eager and graph engines round the cache capacity alike (``engine_for``), so the kernels pick
the same split-KV count in both and the comparison is between equal summation orders; the
graph runners' own first-replay checks must all have found graph == eager bit for bit.
Draft-device tests need two GPUs (marker ``gpu2``).
"""
import dataclasses
import warnings

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.speculative import SpecConfig, speculative_generate_batch
from tests.helpers import random_checkpoint

pytestmark = pytest.mark.gpu

V = 512
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 8, 13)]


def ckpt(name, layers, seed):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    c = load_checkpoint(path, dtype="bfloat16", device="cuda", with_tokenizer=False)
    c.model.attention_backend = "auto"
    return dataclasses.replace(c, stop_ids=[])  # run every row to max_new_tokens: many rounds


def run(mode, target, draft, cfg, graphs, static):
    import simsd.engine.batching as batching
    if mode == "vanilla":
        fn = lambda: vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id,  # noqa: E731
                                            target.stop_ids, cuda_graphs=graphs)
    else:
        fn = lambda: speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode),  # noqa: E731
                                                cuda_graphs=graphs)
    if graphs or not static:
        return fn()
    original = batching.BatchEngine.__init__

    def init(self, *a, **k):
        k["static_shapes"] = True
        original(self, *a, **k)
    batching.BatchEngine.__init__ = init
    try:
        return fn()
    finally:
        batching.BatchEngine.__init__ = original


@pytest.mark.parametrize("mode", ["vanilla", "exact", "paper"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_replay_equals_eager(mode, temperature):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import simsd.engine.batching as batching
    from simsd.engine.graphs import GraphCheckWarning
    batching._POOL.clear()
    target, draft = ckpt("g-target", 3, 0), ckpt("g-draft", 1, 7)
    cfg = DecodeConfig(block_length=4, max_new_tokens=64, sampling=SamplingParams(temperature=temperature))
    eager = run(mode, target, draft, cfg, graphs=False, static=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCheckWarning)
        first = run(mode, target, draft, cfg, graphs=True, static=True)
        again = run(mode, target, draft, cfg, graphs=True, static=True)  # reuses the captured graphs
    (engine,) = batching._POOL.values()
    for runner in engine.graphs.values():  # every shape's first replay was compared with eager
        assert runner.disabled is None and runner.checks
    want = [r.token_ids for r in eager.results]
    assert [r.token_ids for r in first.results] == want
    assert [r.token_ids for r in again.results] == want
    assert all(len(t) == 64 for t in want)
    for key in ("target_forwards", "draft_forwards", "accepted"):
        assert [r.stats.get(key) for r in first.results] == [r.stats.get(key) for r in eager.results]


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_graph_replay_is_bitwise_eager(mode):
    """Equal kernels, equal shapes, equal split counts (equal capacity rounding): the runners'
    first-replay comparisons must have found the logits and the written K/V bit for bit equal."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import simsd.engine.batching as batching
    batching._POOL.clear()
    target, draft = ckpt("g-target", 3, 0), ckpt("g-draft", 1, 7)
    cfg = DecodeConfig(block_length=4, max_new_tokens=16)
    run(mode, target, draft, cfg, graphs=True, static=True)
    (engine,) = batching._POOL.values()
    checks = [c for r in engine.graphs.values() for c in r.checks]
    assert checks and all(diff == 0.0 for _, diff, _ in checks), checks


def test_cli_cuda_graphs_runs(tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from simsd.entrypoints.cli import main
    path = random_checkpoint("g-cli", tokenizer=True)
    assert main(["generate", "--target", str(path), "--draft", str(path), "--mode", "exact", "--cuda-graphs",
                 "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "16", "--device", "cuda"]) == 0


@pytest.mark.gpu2
@pytest.mark.parametrize("graphs", [False, True])
def test_draft_on_a_second_gpu_equals_one_gpu(graphs):
    """``--draft-device cuda:1``: launches, capture and replay run on the tensors' device
    (device guards), and exact-mode greedy output equals the single-GPU run token for token."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    import simsd.engine.batching as batching
    batching._POOL.clear()
    target, draft = ckpt("g-target", 3, 0), ckpt("g-draft", 1, 7)
    path = random_checkpoint("g-draft", tokenizer=False, vocab_size=V, num_hidden_layers=1, seed=7, std=0.2)
    far = dataclasses.replace(load_checkpoint(path, dtype="bfloat16", device="cuda:1", with_tokenizer=False),
                              stop_ids=[])
    far.model.attention_backend = "auto"
    cfg = DecodeConfig(block_length=4, max_new_tokens=32)
    want = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode="exact"), cuda_graphs=graphs)
    torch.cuda.set_device(0)  # the draft's device is never the current one
    got = speculative_generate_batch(target, far, PROMPTS, cfg, SpecConfig(mode="exact"), cuda_graphs=graphs)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
