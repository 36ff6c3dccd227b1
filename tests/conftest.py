"""Test-wide setup.

Without a GPU the Triton kernels run under the interpreter, which must be switched on before
``triton`` is imported anywhere; this file is loaded by pytest before any test module.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--emulate-device", action="store_true",
                     help="run under tests/device_emulation.py: a host tensor meeting one placed on DEVICE "
                          "raises, as it would on a GPU (CI runs the device-agnostic GPU tests so)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``--emulate-device`` each test runs (set-up, call, tear-down: its fixtures' tensors
    too) under tests/device_emulation.py; collection (module-level models) does not."""
    if not item.config.getoption("--emulate-device"):
        yield
        return
    from tests.device_emulation import EmulatedDevice
    with EmulatedDevice():
        yield


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_gpu2 = pytest.mark.skip(reason="needs two CUDA devices")
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_emulated = pytest.mark.skip(reason="no_emulation: on the CPU device by design, or torch.compile")
    for item in items:
        if "no_emulation" in item.keywords and config.getoption("--emulate-device"):
            item.add_marker(skip_emulated)
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
