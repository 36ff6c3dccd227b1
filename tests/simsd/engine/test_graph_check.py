"""CUDA graphs prove themselves (issue 12 item 3), tested on the CPU with eager capture.

The first replay of each captured shape is compared with the same forward run eagerly; a
capture whose replay is wrong (stale logits, corrupted K/V writes) must be caught at once,
turn the engine's graphs off with one warning, and leave the tokens those of eager decoding.
Eager and graph engines round the cache capacity alike, so the kernels pick the same split
count (the same summation order) in both. A mixture-of-experts model whose MoE layers would run
the host-reading torch path is refused before any capture, with the reason (issue 34 item 1;
checked on the CPU by faking a CUDA device and the backends' answers).
"""
import dataclasses
import functools
import warnings
from types import SimpleNamespace

import pytest
import torch

from simsd import DecodeConfig, load_checkpoint
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.engine import batching, graphs
from simsd.engine.graphs import GraphCheckWarning, eager_capture
from simsd.speculative import SpecConfig, speculative_generate_batch
from simsd_kernels import moe
from simsd_kernels.backends import BackendCheckWarning
from simsd_kernels.selfcheck import CheckResult
from tests.helpers import random_checkpoint

V = 96
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8, 13)]
CFG = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)


MOE = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))


def ckpt(name, layers, seed, moe_fields=()):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2,
                             moe=moe_fields)
    return dataclasses.replace(load_checkpoint(path, dtype="float32", with_tokenizer=False), stop_ids=[])


@pytest.fixture(scope="module")
def pair():
    return ckpt("gc-target", 2, 0), ckpt("gc-draft", 1, 5)


@pytest.fixture(scope="module")
def moe_pair():
    """A mixture-of-experts target (2 MoE layers) and a dense draft."""
    return ckpt("gc-moe-target", 2, 0, MOE), ckpt("gc-draft", 1, 5)


@pytest.fixture
def graph_engines(monkeypatch):
    """Graph engines on the CPU: ``capture`` replaces the CUDA capture; returns the list of the
    engines made from then on (the batch functions make one per call)."""
    monkeypatch.setattr(graphs, "check_graphable", lambda model: None)
    made = []
    init = batching.BatchEngine.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(batching.BatchEngine, "__init__", recording)

    def use(capture):
        monkeypatch.setattr(graphs, "cuda_capture", capture)
        return made
    return use


def decode(mode, target, draft, graphs_on):
    if mode == "vanilla":
        return vanilla_generate_batch(target.model, PROMPTS, CFG, target.mask_token_id, [], cuda_graphs=graphs_on)
    return speculative_generate_batch(target, draft, PROMPTS, CFG, SpecConfig(mode=mode), cuda_graphs=graphs_on)


def decode_on(engine, mode, target, draft):
    """The batch decoders' run over a kept engine (as :class:`simsd.LLM` keeps its engine)."""
    from simsd.decoding.config import check_prompt
    from simsd.decoding.program import generate_batch
    from simsd.decoding.vanilla import VanillaRow
    from simsd.speculative.decoder import SpeculativeDecoder
    caps = [check_prompt(p, target.config, CFG.max_new_tokens, 4) for p in PROMPTS]
    if mode == "vanilla":
        return generate_batch(engine, PROMPTS, caps,
                              lambda row, i: VanillaRow(row, CFG, target.mask_token_id, [], CFG.seed + i))
    dec = SpeculativeDecoder(target, draft, CFG, SpecConfig(mode=mode))
    return generate_batch(engine, PROMPTS, caps, lambda row, i: dec.new_row(row, CFG.seed + i))


def stale_capture(fn, cache, device, pool):
    """A broken capture: replay computes nothing (like a CUDA capture, the capture itself runs
    no kernel, so the static output holds whatever the pool held: zeros here)."""
    replay, out, pool = eager_capture(fn, cache, device, pool)
    if out is not None:
        out.zero_()
    return (lambda: None), out, pool


def corrupting_capture(fn, cache, device, pool, shift=1.0):
    """A broken capture whose logits are right but whose K/V writes are off by ``shift`` in layer 0."""
    replay, out, pool = eager_capture(fn, cache, device, pool)

    def bad_replay():
        before = cache.seqlens.clone()
        replay()
        past = torch.arange(cache.max_len)[None, :] >= before[:, None]
        cache.k[0][past] += shift
    return bad_replay, out, pool


def nan_capture(fn, cache, device, pool):
    """A broken capture whose replay leaves NaN in the logits (memory nothing wrote)."""
    replay, out, pool = eager_capture(fn, cache, device, pool)

    def bad_replay():
        replay()
        if out is not None:
            out.fill_(float("nan"))
    return bad_replay, out, pool


def _recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, GraphCheckWarning)]


@pytest.mark.parametrize("mode", ["vanilla", "exact", "paper"])
@pytest.mark.parametrize("target_kind", ["dense", "moe"])
def test_first_replay_of_every_shape_is_checked(request, graph_engines, mode, target_kind):
    made = graph_engines(eager_capture)
    target, draft = request.getfixturevalue("pair" if target_kind == "dense" else "moe_pair")
    want = [r.token_ids for r in decode(mode, target, draft, False).results]
    got, caught = _recorded(lambda: decode(mode, target, draft, True))
    assert [r.token_ids for r in got.results] == want and not caught
    engine = made[-1]
    for runner in engine.graphs.values():
        assert runner.disabled is None
        assert len(runner.checks) == runner.graphs > 0, "one comparison per captured shape"
        assert all(diff == 0.0 for _, diff, _ in runner.checks), runner.checks


@pytest.mark.parametrize("capture,mode", [(stale_capture, "vanilla"), (corrupting_capture, "exact"),
                                          (functools.partial(corrupting_capture, shift=-1.0), "vanilla"),
                                          (nan_capture, "paper")],
                         ids=["stale-logits-vanilla", "corrupt-kv-exact", "kv-minus-one-vanilla", "nan-logits-paper"])
def test_a_wrong_replay_disables_graphs_with_one_warning(pair, graph_engines, capture, mode):
    made = graph_engines(capture)
    target, draft = pair
    want = [r.token_ids for r in decode(mode, target, draft, False).results]
    got, caught = _recorded(lambda: decode(mode, target, draft, True))
    assert [r.token_ids for r in got.results] == want, "after the mismatch the run continues eagerly"
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "differs from eager" in str(caught[0].message) and "disabled" in str(caught[0].message)
    engine = made[-1]
    assert all(r.disabled for r in engine.graphs.values()), "one engine state: every model's graphs are off"
    # a kept engine stays off: no new capture, no new warning in its next run
    shapes = {n: r.graphs for n, r in engine.graphs.items()}
    again, caught = _recorded(lambda: decode_on(engine, mode, target, draft))
    assert [r.token_ids for r in again.results] == want and not caught
    assert {n: r.graphs for n, r in engine.graphs.items()} == shapes


def test_eager_and_graph_engines_pick_the_same_split_count(pair, graph_engines):
    """The split-KV plan of the kernels depends on the cache capacity: eager and graph engines
    of the same request must allocate the same capacity, so equal kernels sum in equal order
    (issue 12: graphs under 256-rounding picked 2 splits where eager picked 1)."""
    from simsd_kernels.split_plan import CUDA_FIGURES, TRITON_FIGURES, DeviceLimits, plan_attention, residency
    made = graph_engines(eager_capture)
    target, _ = pair
    cfg = dataclasses.replace(CFG, max_new_tokens=1)
    prompt = [1 + i % 90 for i in range(989)]  # 989 + 1 tokens in whole blocks, plus a block: 996 -> 1024
    for graphs_on in (False, True):
        vanilla_generate_batch(target.model, [prompt] * 3, cfg, target.mask_token_id, [], cuda_graphs=graphs_on)
    eager, graph = made
    assert not eager.graphs and graph.graphs
    capacity, margin, B = 1000, 8, 3
    lmax = {name: e.caches["target"].k[0].shape[1] for name, e in (("eager", eager), ("graph", graph))}
    assert lmax["eager"] == lmax["graph"] == batching.round_capacity(capacity) + margin
    h200 = DeviceLimits()  # an H100/H200's SM count and limits, no GPU needed
    differs = 0
    for figures in (CUDA_FIGURES, TRITON_FIGURES):
        for Lq in (4, 8, 16):  # denoise, paper verify, exact verify at B=4 (SDAR-8B heads)
            plan = lambda cap: plan_attention(batch=B, q_len=Lq, num_q_heads=32, num_kv_heads=8,  # noqa: E731
                                              head_dim=128, cache_capacity=cap, num_sms=h200.num_sms,
                                              ctas_per_sm=residency(figures, 128, h200))
            plans = {k: plan(v) for k, v in lmax.items()}
            assert plans["eager"] == plans["graph"], (Lq, plans)
            differs += plan(capacity + margin).num_splits != plans["graph"].num_splits
    assert differs, "the test has teeth: the unrounded capacity would split differently somewhere"


# ---- issue 34 item 1: a MoE model is refused up front when its MoE layers would run the torch path


def on_fake_cuda(model, attention=SimpleNamespace(name="triton", fused=True)):
    """``model`` as :func:`graphs.check_graphable` sees it on ``cuda:0`` in bfloat16 (its modules are
    the real ones: the MoE layers and their ``backend`` attribute), its attention running on
    ``attention`` (a stand-in of the fused triton backend's class) in every mask mode."""
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, config=model.config,
                           attention_backend="auto", modules=model.modules,
                           attention_backend_class=lambda mask_mode=None: attention)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device; the fused-MoE choices, verdicts and warnings start empty. Returns a setter of
    the MoE kernels' availability and self-check verdict (which records the ``(device, dtype)`` it
    was asked for)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for name, value in (("_RESOLVED", {}), ("_VERDICTS", {}), ("_WARNED", set())):
        monkeypatch.setattr(moe, name, value)
    checked = []

    def kernels(available=(True, ""), verdict=CheckResult(True, 0.0, 1.0, "case 0: max error 0")):
        monkeypatch.setattr(moe, "triton_availability", lambda device: available)

        def check(run, device, dtype):
            checked.append((device, dtype))
            return verdict
        monkeypatch.setattr(moe, "check_fused_moe", check)
        return checked
    return kernels


def _refusal(model) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendCheckWarning)  # auto's fallback warning: the refusal says it
        with pytest.raises(ValueError) as info:
            graphs.check_graphable(on_fake_cuda(model))
    return str(info.value)


def test_a_model_whose_attention_is_not_fused_is_refused_before_any_capture(pair, fake_cuda):
    """The model says what its attention runs on; the torch reference (it reads the cache lengths on
    the host) is refused, naming the backend and the mask mode."""
    from simsd_kernels.torch_backend import TorchAttention
    with pytest.raises(ValueError) as info:
        graphs.check_graphable(on_fake_cuda(pair[0].model, TorchAttention))
    msg = str(info.value)
    assert "CUDA graphs need the triton or cuda attention backend for the bidirectional mask mode" in msg
    assert "runs on 'torch'" in msg and "reads the cache lengths on the host" in msg


def test_a_moe_model_without_the_fused_moe_kernels_is_refused_before_any_capture(moe_pair, fake_cuda):
    """Triton unavailable: auto's MoE path would be torch, whose ``.tolist()`` of the expert counts
    fails mid-capture; refused at the runner's construction, before a capture, naming why."""
    fake_cuda(available=(False, "triton does not import: No module named 'triton'"))
    target = moe_pair[0].model
    msg = _refusal(target)
    assert "CUDA graphs need the triton fused-MoE backend for the model's 2 mixture-of-experts layers" in msg
    assert "triton does not import: No module named 'triton'" in msg and "torch.bfloat16 on cuda:0" in msg
    assert "reads the expert counts on the host" in msg
    with pytest.raises(ValueError, match="fused-MoE backend"):  # the runner refuses it when it is made
        graphs.GraphRunner(on_fake_cuda(target), None, 4, capture=None)


def test_a_moe_model_whose_kernels_failed_their_self_check_is_refused_with_the_check(moe_pair, fake_cuda):
    fake_cuda(verdict=CheckResult(False, float("nan"), 0.1, "case 2 (T=72 H=96 I=40 E=4 k=2): shape (72, 96), "
                                                              "dtype torch.bfloat16 or non-finite values"))
    msg = _refusal(moe_pair[0].model)
    assert "triton failed its self-check: case 2 (T=72" in msg and "non-finite" in msg


def test_a_moe_model_asking_for_the_torch_path_is_refused(moe_pair, fake_cuda):
    checked = fake_cuda()
    target = moe_pair[0].model
    blocks = [layer.mlp for layer in target.model.layers]
    for b in blocks:
        b.backend = "torch"
    try:
        msg = _refusal(target)
    finally:
        for b in blocks:
            b.backend = "auto"
    assert "the 'torch' backend was requested" in msg and "MoE backend 'torch'" in msg
    assert not checked, "an explicit torch path runs no Triton self-check"


def test_a_moe_model_with_checked_kernels_and_a_dense_model_may_be_captured(pair, moe_pair, fake_cuda):
    """The MoE kernels' self-check runs in check_graphable, once, before any capture; a dense model
    resolves no MoE backend at all."""
    checked = fake_cuda()
    assert graphs.check_graphable(on_fake_cuda(moe_pair[0].model)) is None
    assert checked == [(torch.device("cuda", 0), torch.bfloat16)]
    fake_cuda(available=(False, "must not be asked"))
    assert graphs.check_graphable(on_fake_cuda(pair[0].model)) is None
    assert checked == [(torch.device("cuda", 0), torch.bfloat16)]
