"""Backends prove themselves before ``auto`` trusts them (docs/design.md §5, issue 12 item 1).

Deliberately wrong backends are registered on the CPU: ``auto`` must run each one's self-check
once per configuration, fall back to the next backend with exactly one warning naming the
backend, the configuration and the error, and keep the configuration marked bad; an explicit
request must raise; ``SIMSD_TRUST_BACKENDS=1`` skips the checks; unsupported shapes go to the
next backend under ``auto`` and raise when explicit.
"""
import warnings

import pytest
import torch

import simsd_kernels as sk
from simsd_kernels import backends, selfcheck
from simsd_kernels.backends import BackendCheckError, BackendCheckWarning, OpConfig
from simsd_kernels.torch_backend import TorchAttention
from tests.kernels.helpers import door_attention, function_backend, make_inputs, torch_append_kv, torch_attention

CPU = torch.device("cpu")


def _wrapping(name, attention=None, append_kv=None, head_dims=None):
    """``(backend, calls)``: a backend (door class) named ``name`` on the CPU (auto may pick it
    there) whose attend is ``attention`` and whose cache write is ``append_kv`` (the torch
    reference's by default), and the counts of its calls (``attention``: every attend, the ones of
    its ``forward`` included)."""
    calls = {}
    return function_backend(name, attention, append_kv, head_dims=head_dims, calls=calls), calls


def _scaled_softmax(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale, **paging):
    return torch_attention(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale * 1.25, **paging)


def _ignores_mask(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale, **paging):
    return torch_attention(q, k, v, kc, vc, lens, labels, pos, 0, theta, scale, **paging)


def _ignores_page_order(*args, block_table=None, **plan):
    """Reads a row's pages in ascending id order instead of the table's order."""
    table = None if block_table is None else block_table.sort(dim=1).values.contiguous()
    return torch_attention(*args, block_table=table, **plan)


@pytest.fixture
def register(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.delenv(backends.TRUST_ENV_VAR, raising=False)
    added = []

    def reg(backend, auto_rank=0):
        backends.register_backend(backend, auto_rank=auto_rank)
        added.append(backend.name)
        return backend
    yield reg
    for name in added:
        backends.unregister_backend(name)
    backends.reset()


def _attention(args, mode, backend="auto"):
    return sk.temporal_attention(*args, mask_mode=mode, rope_theta=1e4, backend=backend)


def _recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, BackendCheckWarning)]


def test_auto_falls_back_from_a_wrong_backend_with_one_warning(register):
    backend, calls = _wrapping("wrong", _scaled_softmax)
    register(backend)
    args = make_inputs(1, 2, 7, 4, 2, 64, [5, 0])
    ref = torch_attention(*args, 3, 1e4, 64 ** -0.5)

    out, caught = _recorded(lambda: [_attention(args, "paper") for _ in range(3)])
    for o in out:
        assert torch.equal(o, ref), "auto must give the torch reference's result after the fallback"
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert "'wrong'" in msg and "mask_mode=paper" in msg and "float32" in msg and "head_dim=64" in msg
    assert "group=2" in msg and "max error" in msg
    assert calls["attention"] == 1, "the check runs once per process and configuration, nothing else runs"
    key = ("wrong", CPU, OpConfig("attention", torch.float32, 64, 2, 3))
    assert backends._VERDICTS[key][0] is False

    # another configuration is a new check (and a new warning); the first stays marked bad
    _, caught = _recorded(lambda: _attention([a.to(torch.bfloat16) if a.is_floating_point() else a
                                              for a in args], "exact"))
    assert len(caught) == 1 and "bfloat16" in str(caught[0].message)
    _, caught = _recorded(lambda: _attention(args, "paper"))
    assert not caught


def test_a_correct_configuration_of_the_same_backend_is_used(register):
    """Per configuration: a backend that ignores the mask passes ``bidirectional`` (and runs it)
    but fails ``paper``."""
    backend, calls = _wrapping("maskless", _ignores_mask)
    register(backend)
    args = make_inputs(2, 2, 9, 4, 2, 64, [6, 3])
    _, caught = _recorded(lambda: _attention(args, "bidirectional"))
    n_cases = len(selfcheck.CASES)
    # the check's cases (each attends, then runs forward: attend and write), the paged check's two
    # forwards (contiguous and paged), then the call itself
    assert not caught and calls["attention"] == 2 * n_cases + 2 + 1 and calls["append_kv"] == n_cases + 2
    _, caught = _recorded(lambda: _attention(args, "paper"))
    assert len(caught) == 1 and "mask_mode=paper" in str(caught[0].message)
    assert calls["attention"] == 2 * n_cases + 3 + 1  # only the check ran the failing configuration (its first case)


def test_a_backend_that_reads_pages_out_of_the_table_order_fails_its_check(register):
    """The paged check (:func:`simsd_kernels.selfcheck.check_paged`) catches a backend whose
    contiguous cases are right but which does not follow the block table's page order."""
    backend, calls = _wrapping("page-order", _ignores_page_order)
    res = selfcheck.run_check(backend, CPU, OpConfig("attention", torch.float32, 64, 2, 3))
    assert not res.ok and "paged door" in res.detail, res
    assert selfcheck.run_check(_wrapping("follows")[0], CPU, OpConfig("attention", torch.float32, 64, 2, 3)).ok


def test_explicit_request_of_a_wrong_backend_raises(register, monkeypatch):
    register(_wrapping("wrong", _scaled_softmax)[0], auto_rank=None)
    args = make_inputs(3, 1, 5, 2, 1, 64, [4])
    with pytest.raises(BackendCheckError, match=r"'wrong' failed its self-check .*mask_mode=exact.*max error"):
        _attention(args, "exact", backend="wrong")
    assert issubclass(BackendCheckError, ValueError)
    # the environment variable is an explicit request too
    monkeypatch.setenv(backends.ENV_VAR, "wrong")
    with pytest.raises(BackendCheckError):
        _attention(args, "exact")
    monkeypatch.delenv(backends.ENV_VAR)
    # not in the auto order: auto never tried it
    _, caught = _recorded(lambda: _attention(args, "exact"))
    assert not caught


def test_a_backend_that_raises_or_returns_nan_fails_its_check(register):
    def raises(*a):
        raise RuntimeError("illegal memory access\nsecond line")

    def nan(*a):
        out = torch_attention(*a)
        out[0, 0, 0, 0] = float("nan")
        return out
    register(_wrapping("raises", raises)[0], auto_rank=0)
    register(_wrapping("nans", nan)[0], auto_rank=1)
    args = make_inputs(4, 1, 3, 2, 2, 64, [2])
    out, caught = _recorded(lambda: _attention(args, "block_causal"))
    assert torch.equal(out, torch_attention(*args, 1, 1e4, 64 ** -0.5))
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2, msgs
    assert "'raises'" in msgs[0] and "RuntimeError: illegal memory access" in msgs[0] and "second" not in msgs[0]
    assert "'nans'" in msgs[1] and "NaN" in msgs[1]


@pytest.mark.parametrize("which", [3, 4], ids=["k_cache", "v_cache"])
def test_a_backend_that_reads_unread_cache_slots_fails_its_check(register, which):
    """A kernel that loads cache rows past ``cache_seqlens`` (weighting them 0) is right where the
    unread slots hold finite values and wrong where they hold garbage: the check fills them with
    NaN, so ``0 * NaN`` shows the read."""
    def reads_past(*a):
        return torch_attention(*a) + 0 * a[which].sum()
    register(_wrapping("reads-past", reads_past)[0])
    args = make_inputs(7, 2, 5, 2, 2, 64, [3, 0], lmax=16)
    assert torch.equal(reads_past(*args, 1, 1e4, 64 ** -0.5), torch_attention(*args, 1, 1e4, 64 ** -0.5))
    out, caught = _recorded(lambda: _attention(args, "block_causal"))
    assert torch.equal(out, torch_attention(*args, 1, 1e4, 64 ** -0.5))
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "'reads-past'" in msgs[0] and "NaN" in msgs[0], msgs


def test_wrong_append_kv_falls_back(register):
    def bad_append(k, v, positions, kc, vc, lens, theta, n):
        torch_append_kv(k, v * 2, positions, kc, vc, lens, theta, n)

    def wide_append(k, v, positions, kc, vc, lens, theta, n):
        torch_append_kv(k, v, positions, kc, vc, lens, theta, n)
        kc[:, -1] = 0  # writes a slot it must not touch
    register(_wrapping("badv", append_kv=bad_append)[0], auto_rank=0)
    register(_wrapping("wide", append_kv=wide_append)[0], auto_rank=1)
    _, k, v, kc, vc, lens, _, pos = make_inputs(5, 2, 4, 4, 2, 64, [3, 0], lmax=12)
    kt, vt = kc.clone(), vc.clone()
    _, caught = _recorded(lambda: sk.append_kv(k, v, pos, kc, vc, lens, rope_theta=1e4))
    torch_append_kv(k, v, pos, kt, vt, lens, 1e4, 4)
    assert torch.equal(kc, kt) and torch.equal(vc, vt)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2 and "append_kv float32 head_dim=64" in msgs[0] and "v differs" in msgs[0]
    assert "other slots" in msgs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [-0.5, 0.5])
def test_an_output_off_by_a_constant_fails_either_sign(register, shift, dtype):
    """The check bounds the size of the error: a backend whose attention output, or whose rotated
    k in append_kv, is the reference plus or minus 0.5 fails it (explicit requests raise), in
    float32 and in bfloat16 (the loosest error floor, 1.6e-2)."""
    def attention(*a):
        return torch_attention(*a) + shift

    def append(k, v, positions, kc, vc, lens, theta, n):
        torch_append_kv(k, v, positions, kc, vc, lens, theta, n)
        for b, c in enumerate(lens.tolist()):
            kc[b, c:c + n] += shift
    register(_wrapping("shifted", attention, append)[0], auto_rank=None)
    to = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    args = [to(a) for a in make_inputs(8, 2, 6, 4, 2, 64, [5, 0])]
    with pytest.raises(BackendCheckError, match=r"'shifted' failed its self-check .*max error 0\.5"):
        _attention(args, "exact", backend="shifted")
    _, k, v, kc, vc, lens, _, pos = [to(a) for a in make_inputs(8, 2, 4, 4, 2, 64, [3, 0], lmax=12)]
    with pytest.raises(BackendCheckError, match=r"'shifted' failed its self-check .*rotated k error 0\.5"):
        sk.append_kv(k, v, pos, kc, vc, lens, rope_theta=1e4, backend="shifted")


def test_trust_env_skips_the_checks(register, monkeypatch):
    backend, calls = _wrapping("wrong", _scaled_softmax)
    register(backend)
    monkeypatch.setenv(backends.TRUST_ENV_VAR, "1")
    args = make_inputs(6, 1, 4, 2, 1, 64, [3])
    out, caught = _recorded(lambda: _attention(args, "paper"))
    assert not caught and calls["attention"] == 1
    assert not torch.allclose(out, torch_attention(*args, 3, 1e4, 64 ** -0.5)), \
        "trusted: the wrong backend ran unchecked"
    assert not backends._VERDICTS


@pytest.mark.parametrize("head_dim", [48, 96])
def test_unsupported_head_dim_goes_to_the_next_backend(register, head_dim):
    """A kernel that supports head_dim 64/128 only: ``auto`` passes a trained pair's head_dim 48
    (or 96) to the next backend without a warning; asking for it by name is an error."""
    def must_not_run(*a):
        raise AssertionError("called with an unsupported head_dim")
    narrow, calls = _wrapping("narrow", must_not_run, head_dims=(64, 128))
    register(narrow)
    args = make_inputs(7, 1, 5, 4, 2, head_dim, [6])
    out, caught = _recorded(lambda: _attention(args, "paper"))
    assert not caught and calls["attention"] == 0
    assert torch.equal(out, torch_attention(*args, 3, 1e4, head_dim ** -0.5))
    with pytest.raises(ValueError, match=rf"'narrow' does not support attention float32 head_dim={head_dim}"):
        _attention(args, "paper", backend="narrow")
    with pytest.raises(ValueError, match=rf"head_dim={head_dim}"):
        sk.append_kv(*[args[i] for i in (1, 2, 7, 3, 4, 5)], rope_theta=1e4, backend="narrow")
    # the one support rule holds for a door opened directly too (the self-check, tests)
    q, k, v, kc, vc, lens, labels, pos = args
    with pytest.raises(ValueError, match=rf"'narrow': head_dim {head_dim} is not one of \(64, 128\)"):
        narrow.open(q, k, kc, lens, labels, pos, mask_mode="paper", rope_theta=1e4)
    assert narrow.supports(torch.float32, 64) == (True, "") and calls["attention"] == 0


def test_triton_refuses_head_dim_48_by_name_and_auto_takes_torch(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    from simsd_kernels.triton_backend import TritonAttention
    supports = TritonAttention.supports
    assert supports(torch.float16, 48)[0] is False and supports(torch.bfloat16, 128)[0] is True
    assert supports(torch.float64, 64)[0] is False
    args = make_inputs(8, 1, 3, 2, 1, 48, [2])
    assert backends.resolve_backend("auto", CPU, OpConfig("attention", torch.float32, 48, 2, 3)).name == "torch"
    try:
        backends.resolve_backend("triton", CPU)
    except ValueError as exc:
        pytest.skip(f"triton backend unavailable here: {exc}")
    with pytest.raises(ValueError, match="'triton' does not support attention float32 head_dim=48"):
        _attention(args, "paper", backend="triton")


def test_resolution_is_cached(register):
    """After the first call of a configuration, resolving costs a lookup: no availability
    query, no check (the eager host overhead of issue 12)."""
    backend, calls = _wrapping("counted")
    register(backend)
    args = make_inputs(9, 1, 5, 4, 2, 64, [3])
    for _ in range(4):
        _attention(args, "exact")
    assert calls["available"] == 1
    # one check (attend and forward per case, two paged-check forwards), four calls
    assert calls["attention"] == 2 * len(selfcheck.CASES) + 2 + 4
    cfg = OpConfig("attention", torch.float32, 64, 2, 2)
    assert backends.resolve_backend("auto", CPU, cfg) is backend
    assert backends.resolve_backend("counted", CPU, cfg) is backend
    assert calls["available"] == 1


def test_registry_names_and_errors(register):
    register(_wrapping("extra")[0], auto_rank=None)
    assert "extra" in backends.backend_names() and set(backends.BACKEND_NAMES) <= set(backends.backend_names())
    with pytest.raises(ValueError, match="cannot register"):
        backends.register_backend(type("Torch", (_wrapping("x")[0],), {"name": "torch"}))
    with pytest.raises(ValueError, match="subclass of AttentionMetadata"):
        backends.register_backend(torch_attention)
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.resolve_backend("nope", CPU)
    backends.unregister_backend("extra")
    assert "extra" not in backends.backend_names()


@pytest.mark.gpu
def test_on_the_gpu_auto_uses_a_checked_fused_backend_and_skips_a_wrong_one(register):
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = OpConfig("attention", torch.bfloat16, 128, 4, 3)
    fused = backends.resolve_backend("auto", dev, cfg)
    assert fused.name in ("cuda", "triton"), "no fused backend passed its check on this GPU"
    assert backends._VERDICTS[(fused.name, dev, cfg)] == (True, backends._VERDICTS[(fused.name, dev, cfg)][1])
    wrong = function_backend("wrong", _scaled_softmax, auto_devices=("cuda",))
    register(wrong)
    args = [a.to(dev) for a in make_inputs(10, 2, 9, 8, 2, 128, [40, 600], dtype=torch.bfloat16, lmax=640)]
    out, caught = _recorded(lambda: _attention(args, "paper"))
    assert len(caught) == 1 and "'wrong'" in str(caught[0].message) and "cuda" in str(caught[0].message)
    assert backends.resolve_backend("auto", dev, cfg).name == fused.name
    torch.testing.assert_close(out, door_attention(fused, *args, 3, 1e4, 128 ** -0.5), atol=0, rtol=0)


# ---- what the self-check covers, and the errors its tolerance must catch in bfloat16 ----------

def _rotate(x, positions, theta, angle_factor=1.0):
    """RoPE as the fused kernels apply it: in float32, rounded once to x's dtype; the angles
    times ``angle_factor`` (1.001: a 0.1% angle error)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([positions.to(torch.float64)[..., None] * inv_freq * angle_factor] * 2, -1)
    cos, sin = ang.cos().float()[:, :, None], ang.sin().float()[:, :, None]
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def _fused_numerics(angle_factor=1.0, scale_factor=1.0, p_in_dtype=False):
    """The reference with the fused kernels' rounding (q, k rotated once in float32), optionally
    with a wrong softmax scale or RoPE angle, or with the softmax weights rounded to the input dtype
    per 64-key tile before the PV product (as the tensor-core kernels do)."""
    def attention(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale, block_table=None):
        if block_table is not None:  # the paged check: the rows' slots gathered through the table
            from simsd_kernels.paging import gather_rows
            kc, vc = (gather_rows(c, block_table, c.shape[1], slice(None), c.shape[1] * block_table.shape[1])
                      for c in (kc, vc))
        qr, kr = _rotate(q, pos, theta, angle_factor), _rotate(k, pos, theta, angle_factor)
        if not p_in_dtype:
            return torch_attention(qr, kr, v, kc, vc, lens, labels, torch.zeros_like(pos), mode, theta,
                                   scale * scale_factor)
        from simsd_kernels.reference import full_mask
        used = int(lens.max())
        g = q.shape[2] // k.shape[2]
        keys = torch.cat([kc[:, :used], kr], 1).float().nan_to_num(0.0).repeat_interleave(g, 2).transpose(1, 2)
        vals = torch.cat([vc[:, :used], v], 1).float().nan_to_num(0.0).repeat_interleave(g, 2).transpose(1, 2)
        s = torch.einsum("bqhd,bhkd->bhqk", qr.float(), keys) * scale
        s = s.masked_fill(~full_mask(lens, labels, mode, used)[:, None], float("-inf"))
        m = torch.full(s.shape[:-1], float("-inf"))
        acc, total = torch.zeros(*s.shape[:-1], q.shape[3]), torch.zeros(s.shape[:-1])
        for t in range(0, s.shape[-1], 64):  # online softmax over 64-key tiles
            m_new = torch.maximum(m, s[..., t:t + 64].amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha, p = torch.exp(m - m_safe), torch.exp(s[..., t:t + 64] - m_safe[..., None])
            total = total * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p.to(q.dtype).float() @ vals[:, :, t:t + 64]
            m = m_new
        return (acc / torch.where(total > 0, total, 1.0)[..., None]).transpose(1, 2).to(q.dtype)
    return function_backend("fused-numerics", attention)


#: SDAR's head size and GQA groups (1.7B: 2, 8B: 4) in every mask mode, and one D64 G1 configuration
SDAR_CONFIGS = [OpConfig("attention", torch.bfloat16, 128, g, m) for g in (2, 4) for m in range(4)] + \
    [OpConfig("attention", torch.bfloat16, 64, 1, 3)]


@pytest.mark.no_emulation  # stand-in backends on the CPU device by design
@pytest.mark.parametrize("mutant", ["softmax scale 1% off", "RoPE angles 0.1% off"])
def test_the_tolerance_catches_small_systematic_errors_in_bfloat16(mutant):
    """bfloat16 rounds the largest outputs by ~0.8% of their size: a max-error bound alone passes a
    softmax scale 1% off. The self-check also bounds the mean error, and fails both mutants in
    every configuration, while the same numerics without the error pass."""
    wrong = _fused_numerics(scale_factor=1.01) if "scale" in mutant else _fused_numerics(angle_factor=1.001)
    for config in SDAR_CONFIGS:
        res = selfcheck.run_check(wrong, CPU, config)
        assert not res.ok, (config.describe(), res.detail)
        assert "error" in res.detail


@pytest.mark.no_emulation  # stand-in backends on the CPU device by design
@pytest.mark.parametrize("backend", ["fused numerics", "P in bfloat16 per tile", "torch"])
def test_correct_numerics_pass_the_tolerance_in_bfloat16(backend):
    impl = {"fused numerics": _fused_numerics(), "P in bfloat16 per tile": _fused_numerics(p_in_dtype=True),
            "torch": TorchAttention}[backend]
    for config in SDAR_CONFIGS:
        res = selfcheck.run_check(impl, CPU, config)
        assert res.ok, (config.describe(), res.detail)


def test_the_cases_reach_split_merge_the_largest_tile_the_invariant_plan_and_a_skipped_tile():
    """Per configuration the self-check runs a forced multi-split plan (split-KV + merge) for every
    GQA group, the 64-row query tile, the shape-invariant plan, more than 64 new tokens and a
    new-key tile that a query tile skips (every mask mode but bidirectional, where all is seen)."""
    from simsd_kernels.split_plan import BLOCK_MS, TRITON_FIGURES, active_splits, plan_for
    seen = []

    def recording(*args, **plan):
        seen.append((args, plan))
        return torch_attention(*args, block_table=plan.get("block_table"))  # the paged check's table
    backend = function_backend("recording", recording, plan_options=True)
    for group in (1, 2, 4, 8):
        for mode in range(4):
            seen.clear()
            assert selfcheck.run_check(backend, CPU, OpConfig("attention", torch.float32, 64, group, mode)).ok
            plans = [p for _, p in seen]
            assert {"num_splits": 3} in plans and {"shape_invariant": True} in plans
            for args, plan in seen:
                q, k, kc, lens, labels = args[0], args[1], args[3], args[5], args[6]
                assert q.shape[2] == group * k.shape[2]
                p = plan_for(q, k, kc, figures=TRITON_FIGURES, num_splits=plan.get("num_splits", 0),
                             invariant=plan.get("shape_invariant", False))
                if plan.get("num_splits"):  # split-KV + merge for the long row, one split for the empty one
                    assert active_splits(p.num_splits, p.min_tiles, p.invariant, int(lens.max()), q.shape[1]) == 3
                    assert active_splits(p.num_splits, p.min_tiles, p.invariant, int(lens.min()), q.shape[1]) == 1
                if q.shape[1] > 64:
                    assert p.invariant and p.block_m == BLOCK_MS[-1]
                    skipped = selfcheck.skipped_tiles(labels, mode, group, BLOCK_MS[-1])
                    assert (skipped > 0) == (mode != 0), (group, mode, skipped)
            assert any(a[0].shape[1] > 64 for a, _ in seen)
    # a backend without plan options runs each case once (its door opened once: attend, then forward), with its
    # own plan
    seen.clear()
    counted = function_backend("counted", recording)
    assert selfcheck.run_check(counted, CPU, OpConfig("attention", torch.float32, 64, 2, 3)).ok
    assert len(seen) == 2 * len(selfcheck.CASES) + 2 and all(plan == {} for _, plan in seen[:-1])
    assert set(seen[-1][1]) == {"block_table"}  # the paged check: the contiguous forward, then the paged one


def test_the_triton_kernels_pass_the_selfcheck_in_bfloat16():
    pytest.importorskip("triton")
    try:
        triton = backends.resolve_backend("triton", CPU)
    except ValueError as exc:
        pytest.skip(f"triton backend unavailable here: {exc}")
    for config in (OpConfig("attention", torch.bfloat16, 128, 4, 3), OpConfig("attention", torch.bfloat16, 128, 2, 2)):
        res = selfcheck.run_check(triton, CPU, config)
        assert res.ok, (config.describe(), res.detail)


def _door_backend(name, wrong):
    """The torch backend under another name, with a ``forward`` (the door's write-then-attend) that
    is wrong in one way; its ``attend`` is right."""
    class WrongDoor(TorchAttention):
        auto_devices = ("cpu",)

        def forward(self, q, k, v, k_cache, v_cache, write=True):
            if write and wrong == "unrotated k":  # the new keys cached as they came (RoPE forgotten in the write)
                out = super().forward(q, k, v, k_cache.clone(), v_cache, write)
                rows = torch.arange(q.shape[0])[:, None]
                slots = self.cache_seqlens.long()[:, None] + torch.arange(q.shape[1])
                keep = slots < k_cache.shape[1]
                k_cache[rows.expand_as(slots)[keep], slots[keep]] = k[keep]
                return out
            if write and wrong == "no write":
                return super().forward(q, k, v, k_cache, v_cache, False)
            return super().forward(q, k, v, k_cache, v_cache, write)
    WrongDoor.name = name
    return WrongDoor


@pytest.mark.no_emulation  # stand-in backends on the CPU device by design
@pytest.mark.parametrize("wrong", ["unrotated k", "no write", None])
def test_the_door_of_a_backend_is_checked_too(wrong):
    """A backend's own write-then-attend path (the one the model runs) is held to the same bound and
    must cache exactly the new tokens, rotated: a correct attention does not hide a wrong door."""
    config = OpConfig("attention", torch.bfloat16, 64, 2, int(sk.MaskMode.EXACT))
    res = selfcheck.run_check(_door_backend("door", wrong), CPU, config)
    assert res.ok == (wrong is None), res
    if wrong:
        assert "door" in res.detail, res.detail
