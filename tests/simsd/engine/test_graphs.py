"""CUDA-graph replay is token-identical to eager decoding with the same shapes (GPU only).

Eager and graph engines round the cache capacity alike (``round_capacity``), so the kernels pick
the same split-KV count in both and the comparison is between equal summation orders; the
graph runners' own first-replay checks must all have found graph == eager bit for bit.
Draft-device tests need two GPUs (marker ``gpu2``). A mixture-of-experts target runs its experts
through the Triton fused-MoE kernels under the graphs (check_graphable resolves and self-checks
them before the first capture).
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


#: the mixture-of-experts fields of the MoE target (a MoE layer per decoder layer)
MOE = (("num_experts", 16), ("num_experts_per_tok", 4), ("moe_intermediate_size", 64))


def ckpt(name, layers, seed, moe=()):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2,
                             moe=moe)
    c = load_checkpoint(path, dtype="bfloat16", device="cuda", with_tokenizer=False)
    c.model.attention_backend = "auto"
    return dataclasses.replace(c, stop_ids=[])  # run every row to max_new_tokens: many rounds


ENGINES: list = []  # the engines the batch functions made (one per call)


def run(mode, target, draft, cfg, graphs, static):
    import simsd.engine.batching as batching
    if mode == "vanilla":
        fn = lambda: vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id,  # noqa: E731
                                            target.stop_ids, cuda_graphs=graphs)
    else:
        fn = lambda: speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode),  # noqa: E731
                                                cuda_graphs=graphs)
    original = batching.BatchEngine.__init__

    def init(self, *a, **k):
        if static and not graphs:
            k["static_shapes"] = True
        original(self, *a, **k)
        ENGINES.append(self)
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
    from simsd.engine.graphs import GraphCheckWarning
    target, draft = ckpt("g-target", 3, 0), ckpt("g-draft", 1, 7)
    cfg = DecodeConfig(block_length=4, max_new_tokens=64, sampling=SamplingParams(temperature=temperature))
    eager = run(mode, target, draft, cfg, graphs=False, static=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCheckWarning)
        ENGINES.clear()
        first = run(mode, target, draft, cfg, graphs=True, static=True)
        again = run(mode, target, draft, cfg, graphs=True, static=True)  # a new engine: captured again
    for engine in ENGINES:
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
    target, draft = ckpt("g-target", 3, 0), ckpt("g-draft", 1, 7)
    cfg = DecodeConfig(block_length=4, max_new_tokens=16)
    ENGINES.clear()
    run(mode, target, draft, cfg, graphs=True, static=True)
    (engine,) = ENGINES
    checks = [c for r in engine.graphs.values() for c in r.checks]
    assert checks and all(diff == 0.0 for _, diff, _ in checks), checks


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_moe_graph_replay_equals_eager(mode):
    """A MoE target (16 experts, top 4) with a dense draft: graphs == eager token for token, every
    shape's first replay compared, the MoE layers on the fused Triton kernels (never the host-reading
    torch path, which a capture cannot run)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from simsd.engine.graphs import GraphCheckWarning
    from simsd_kernels.moe import resolve_moe_backend
    target, draft = ckpt("g-moe-target", 2, 3, MOE), ckpt("g-draft", 1, 7)
    assert resolve_moe_backend("auto", target.model.device, target.model.dtype) == "triton"
    cfg = DecodeConfig(block_length=4, max_new_tokens=32)
    eager = run(mode, target, draft, cfg, graphs=False, static=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCheckWarning)
        ENGINES.clear()
        graphed = run(mode, target, draft, cfg, graphs=True, static=True)
    (engine,) = ENGINES
    assert all(r.disabled is None and r.checks for r in engine.graphs.values())
    assert [r.token_ids for r in graphed.results] == [r.token_ids for r in eager.results]
    assert all(len(r.token_ids) == 32 for r in eager.results)


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


def test_llm_keeps_its_engine_and_graphs():
    """Whoever wants graphs reused holds the engine: an LLM captures each shape once, in its first
    generate call, and replays it in the next, with the same tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import simsd
    target, draft = ckpt("g-target", 3, 0), ckpt("g-draft", 1, 7)
    llm = simsd.LLM(target, draft, mode="exact", batch_size=3, max_model_len=128, cuda_graphs=True,
                    scheduler_thread=False)
    params = simsd.SamplingParams(max_tokens=32, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    runners = llm.engine.graphs.values()
    shapes, replays = [r.graphs for r in runners], [r.replays for r in runners]
    again = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert again == first and all(len(t) == 32 for t in first)
    assert [r.graphs for r in runners] == shapes and all(s > 0 for s in shapes)
    assert all(r.replays > n for r, n in zip(runners, replays)) and all(r.disabled is None for r in runners)
