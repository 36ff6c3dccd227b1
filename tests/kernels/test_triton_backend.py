"""Availability rules of the triton backend and its place in the ``auto`` order."""
import pytest
import torch

pytest.importorskip("triton")

from simsd_kernels import backends  # noqa: E402
from simsd_kernels.triton_backend import TritonAttention  # noqa: E402

is_available = TritonAttention.is_available


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


@pytest.mark.parametrize("triton_version,numpy_version,broken", [
    ("3.6.0", "2.4.6", True), ("3.5.1", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
    ("3.9.0", "2.4.6", False), ("3.6.0+git1a2b", "2.10.0", True)])
def test_interpreter_problem_names_triton_before_3_7_under_numpy_2_4(triton_version, numpy_version, broken):
    """Issue 34 item 6: Triton <= 3.6's interpreter fails under NumPy >= 2.4 (measured with 3.6.0 and
    2.4.6: ``only 0-dimensional arrays can be converted to Python scalars``); said in one line."""
    from simsd_kernels.triton_backend import interpreter_problem
    problem = interpreter_problem(triton_version, numpy_version)
    assert bool(problem) == broken
    if broken:
        assert f"Triton {triton_version}'s interpreter fails under NumPy {numpy_version}" in problem
        assert "numpy<2.4 or triton>=3.7" in problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter rules")
def test_the_cpu_is_refused_when_the_installed_interpreter_cannot_run(monkeypatch):
    """The installed versions (faked here) decide: the CPU is not available, with the reason, so
    ``triton`` asked for by name raises it instead of the interpreter's TypeError mid-kernel."""
    import numpy
    import triton
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert is_available(torch.device("cpu")) == (True, "")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    ok, why = is_available(torch.device("cpu"))
    assert not ok and "Triton 3.6.0's interpreter fails under NumPy 2.4.6" in why
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.reset()
    try:
        with pytest.raises(ValueError, match="fails under NumPy 2.4.6"):
            backends.resolve_backend("triton", torch.device("cpu"))
    finally:
        backends.reset()
