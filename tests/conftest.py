"""Test-wide setup.

Without a GPU the Triton kernels run under the interpreter, which must be switched on before
``triton`` is imported anywhere; this file is loaded by pytest before any test module.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_gpu2 = pytest.mark.skip(reason="needs two CUDA devices")
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu2" in item.keywords:
            item.add_marker(pytest.mark.gpu)  # selected by -m gpu too
            if devices < 2:
                item.add_marker(skip_gpu2)
        if "gpu" in item.keywords and devices < 1:
            item.add_marker(skip_gpu)


def pytest_report_header(config):
    """One line when the installed Triton's interpreter cannot run the kernels (Triton <= 3.6 under
    NumPy >= 2.4: simsd_kernels.triton_backend.interpreter_problem), so the failures say why."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from simsd_kernels.triton_backend import interpreter_problem
        problem = interpreter_problem()
    except ImportError:
        return None
    return f"simsd: {problem}; the Triton interpreter's tests will fail" if problem else None
