"""Availability rules of the triton backend and its place in the ``auto`` order."""
import pytest
import torch

pytest.importorskip("triton")

from simsd_kernels import backends  # noqa: E402
from simsd_kernels.triton_backend import is_available  # noqa: E402
from triton_ops import ops  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter rules")
def test_cpu_needs_the_interpreter(monkeypatch):
    assert ops.INTERPRETED  # conftest set TRITON_INTERPRET=1 before triton was imported
    assert is_available(torch.device("cpu")) == (True, "")
    monkeypatch.delenv("TRITON_INTERPRET")
    ok, why = is_available(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET" in why
    assert not is_available(torch.device("cuda"))[0]  # interpreted kernels cannot run on CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter rules")
def test_auto_order_prefers_triton_over_torch(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    cuda = backends.get_backend("cuda")
    expected = "cuda" if cuda is not None and cuda.is_available(torch.device("cpu"))[0] else "triton"
    assert backends.resolve_backend("auto", torch.device("cpu")).name == expected
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert backends.resolve_backend("auto", torch.device("cpu")).name == "torch"


@pytest.mark.gpu
def test_cuda_device_available():
    assert is_available(torch.device("cuda")) == (True, "")
    assert backends.resolve_backend("triton", torch.device("cuda")).name == "triton"
