"""``simsd::temporal_attention`` / ``simsd::append_kv`` custom ops: opcheck, torch.compile, api."""
import pytest
import torch

import simsd_kernels as sk
from simsd_kernels.backends import resolve_backend
from simsd_kernels.custom_ops import append_kv_op, temporal_attention_op
from tests.kernels.helpers import available_backends, door_attention, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _backends():
    return available_backends(DEVICE)


@pytest.mark.parametrize("backend", _backends())
def test_opcheck_temporal_attention(backend):
    args = [a.to(DEVICE) for a in make_inputs(1, 2, 5, 4, 2, 64, [6, 0])]
    torch.library.opcheck(temporal_attention_op, (*args, 3, 1e4, 0.125, backend),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("backend", _backends())
def test_opcheck_append_kv(backend):
    _, k, v, kc, vc, lens, _, pos = [a.to(DEVICE) for a in make_inputs(2, 2, 5, 4, 2, 64, [6, 0])]
    torch.library.opcheck(append_kv_op, (k, v, pos, kc, vc, lens, 1e4, 3, backend),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.no_emulation
@pytest.mark.parametrize("backend", _backends())
def test_torch_compile_fullgraph_equals_eager(backend):
    args = [a.to(DEVICE) for a in make_inputs(3, 2, 6, 4, 2, 64, [9, 1])]

    def f(*a):
        return sk.temporal_attention(*a, mask_mode="exact", rope_theta=1e4, backend=backend) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), f(*args), atol=0, rtol=0)


def test_api_out_and_errors():
    args = make_inputs(4, 1, 3, 2, 1, 64, [2])
    out = torch.full_like(args[0], float("nan"))
    res = sk.temporal_attention(*args, mask_mode="paper", rope_theta=1e4, backend="torch", out=out)
    assert res is out and not out.isnan().any()
    with pytest.raises(ValueError, match="backend"):
        sk.temporal_attention(*args, mask_mode="paper", rope_theta=1e4, backend="nope")
    with pytest.raises(ValueError, match="mask_mode"):
        sk.temporal_attention(*args, mask_mode="causal", rope_theta=1e4)


def test_triton_backend_rejects_unsupported_head_dim():
    pytest.importorskip("triton")
    try:
        impl = resolve_backend("triton", torch.device(DEVICE))
    except ValueError as exc:
        pytest.skip(f"triton backend unavailable here: {exc}")
    args = [a.to(DEVICE) for a in make_inputs(5, 1, 3, 2, 1, 32, [2])]
    with pytest.raises(ValueError, match="'triton': head_dim 32 is not one of"):
        door_attention(impl, *args, 0, 1e4, 0.1)
    with pytest.raises(ValueError, match="'triton': dtype torch.float64 is not one of"):
        door_attention(impl, *[a.double() if a.is_floating_point() else a for a in
                               make_inputs(5, 1, 3, 2, 1, 64, [2])], 0, 1e4, 0.1)


def _gpu_backends():
    return [b for b in _backends() if b != "torch"] if DEVICE == "cuda" else ["triton", "cuda"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _gpu_backends())
def test_cuda_graph_replay_reads_device_lengths(backend):
    """Capture once; change cache_seqlens / labels in place; replay equals eager (no host sync)."""
    if backend not in _backends():
        pytest.skip(f"{backend} backend unavailable here")
    args = [a.cuda() for a in make_inputs(6, 2, 8, 8, 2, 128, [300, 17], dtype=torch.bfloat16, lmax=512)]

    def run():
        return sk.temporal_attention(*args, mask_mode="paper", rope_theta=1e6, backend=backend)

    run()  # compile (and self-check) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    args[5].copy_(torch.tensor([511 - 8, 0], dtype=torch.int32))
    args[6][..., 0].fill_(2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run(), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _gpu_backends())
def test_cuda_graph_append_kv_writes_at_device_lengths(backend):
    """``append_kv`` captured once writes at the lengths found in ``cache_seqlens`` at replay."""
    if backend not in _backends():
        pytest.skip(f"{backend} backend unavailable here")
    _, k, v, kc, vc, lens, _, pos = [a.cuda() for a in make_inputs(7, 2, 5, 4, 2, 128, [3, 0], dtype=torch.float16,
                                                                    lmax=32)]

    def run(k_cache, v_cache):
        sk.append_kv(k, v, pos, k_cache, v_cache, lens, rope_theta=1e6, backend=backend)

    run(kc.clone(), vc.clone())  # compile (and self-check) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(kc, vc)
    lens.copy_(torch.tensor([20, 9], dtype=torch.int32))
    before_k, before_v = kc.clone(), vc.clone()
    graph.replay()
    want_k, want_v = before_k.clone(), before_v.clone()
    run(want_k, want_v)
    torch.cuda.synchronize()
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert not torch.equal(kc[0, 20:25], before_k[0, 20:25]), "the replay wrote at the new lengths"
