"""Availability rules of the triton backend and its place in the ``auto`` order."""
import pytest
import torch

pytest.importorskip("triton")

from simsd_kernels import backends  # noqa: E402
from simsd_kernels.triton_backend import is_available  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter rules")
def test_auto_never_picks_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.resolve_backend("auto", torch.device("cpu")).name == "torch"
    # explicit requests still reach the interpreted kernels (tests) ...
    assert backends.resolve_backend("triton", torch.device("cpu")).name == "triton"
    # ... and so does the environment override
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    assert backends.resolve_backend("auto", torch.device("cpu")).name == "triton"
    monkeypatch.setenv(backends.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=backends.ENV_VAR):
        backends.resolve_backend("auto", torch.device("cpu"))


@pytest.mark.gpu
def test_cuda_device_available():
    assert is_available(torch.device("cuda")) == (True, "")
    assert backends.resolve_backend("triton", torch.device("cuda")).name == "triton"
