"""Build script: the pure-Python package, plus the CUDA extension ``simsd_kernels._C`` when it can.

The extension (csrc/, see csrc/README.md) is built with ninja when a CUDA-enabled torch and
nvcc are both present; otherwise the install stays pure Python and says why. Nothing is ever
downloaded. Install torch first, then::

    pip install --no-build-isolation .          # or -e . for a development checkout

Environment:

* ``SIMSD_SKIP_CUDA_BUILD=1``  never build the extension;
* ``SIMSD_REQUIRE_CUDA_EXT=1`` fail (exit status 1, the reason on stderr) instead of installing
  pure Python when the extension cannot be built (the GPU device script sets it);
* ``SIMSD_CUDA_ARCHS="80;90"`` SM archs to compile for (default ``80;90``; PTX of the highest
  is embedded too); sm_80 is the minimum (mma.sync bf16);
* ``MAX_JOBS``                  parallel compile jobs (torch's ninja builder reads it);
* ``CUDA_HOME``                 the CUDA toolkit (found from nvcc otherwise).

A successful build writes ``simsd_kernels/_build_info.json`` next to the extension (archs,
versions, flags), which :mod:`simsd_kernels.cuda_backend` reads. Any setuptools from 64 on builds
(``--no-build-isolation`` uses the installed one): the licence is given in the form it reads,
PEP 639's ``license_expression`` from setuptools 77 on, the ``License`` field before (a PEP 639
``license`` string in pyproject.toml made setuptools < 77 stop the build: issue 34 item 5); one
line names the setuptools in use.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
DEFAULT_ARCHS = "80;90"
LICENSE = "Apache-2.0"
#: the first setuptools that reads PEP 639's ``license_expression`` (older ones: the ``License`` field)
SETUPTOOLS_PEP639 = (77, 0)


def _log(msg: str) -> None:
    print(f"simsd setup: {msg}", file=sys.stderr)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _parse_archs(spec: str) -> list[int]:
    """``"80;90"`` / ``"8.0 9.0"`` -> ``[80, 90]``; raise ``ValueError`` on a bad or < sm_80 entry."""
    archs = []
    for tok in spec.replace(",", ";").replace(" ", ";").split(";"):
        tok = tok.strip().lower().removeprefix("sm_")
        if not tok:
            continue
        num = int(tok.replace(".", "")) if tok.replace(".", "").isdigit() else None
        if num is None or num < 80:
            raise ValueError(f"SIMSD_CUDA_ARCHS: {tok!r} is not an SM arch >= 80 (e.g. '80;90')")
        archs.append(num)
    if not archs:
        raise ValueError("SIMSD_CUDA_ARCHS is empty")
    return sorted(set(archs))


def _license_metadata(setuptools_version: str) -> dict:
    """``setup()``'s licence keyword for this setuptools: ``license_expression`` (PEP 639, setuptools
    >= 77, which deprecates the free-text ``license``), else ``license``."""
    m = re.match(r"(\d+)\.(\d+)", setuptools_version)
    version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return {"license_expression": LICENSE} if version >= SETUPTOOLS_PEP639 else {"license": LICENSE}


def _setuptools_line() -> dict:
    """One line naming the setuptools in use; returns :func:`_license_metadata` for it."""
    import setuptools
    meta = _license_metadata(setuptools.__version__)
    _log(f"setuptools {setuptools.__version__}: licence {LICENSE} as {next(iter(meta))}")
    return meta


def _find_cuda_home() -> str | None:
    """The toolkit root holding bin/nvcc and include/cuda_runtime.h (nvcc may be a wrapper script)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "bin", "nvcc")) and os.path.isfile(
                os.path.join(c, "include", "cuda_runtime.h")):
            return c
    return None


def _nvcc_version(cuda_home: str) -> str:
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else "unknown"


def _git_sha() -> str | None:
    """``$SIMSD_GIT_SHA`` (a copy of the checkout without ``.git``: bench/device_run.sh), else git's."""
    if os.environ.get("SIMSD_GIT_SHA", "").strip():
        return os.environ["SIMSD_GIT_SHA"].strip()
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _pure_python(reason: str):
    """``([], {})`` with ``reason`` logged; with ``SIMSD_REQUIRE_CUDA_EXT=1`` a loud failure instead."""
    if _truthy("SIMSD_REQUIRE_CUDA_EXT"):
        raise SystemExit(f"simsd setup: error: SIMSD_REQUIRE_CUDA_EXT=1 but the CUDA extension cannot be built: "
                         f"{reason}")
    _log(f"{reason}: pure-Python install, no CUDA extension")
    return [], {}


def _cuda_extension():
    """``(ext_modules, cmdclass)`` for the CUDA build, or ``([], {})`` with the reason logged."""
    if _truthy("SIMSD_SKIP_CUDA_BUILD"):
        return _pure_python("SIMSD_SKIP_CUDA_BUILD is set")
    try:
        import torch
    except ImportError:
        return _pure_python("torch is not importable (install torch first, then pip install --no-build-isolation .)")
    if not torch.version.cuda:
        return _pure_python(f"torch {torch.__version__} is not a CUDA build")
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        return _pure_python("nvcc / the CUDA toolkit was not found (set CUDA_HOME)")
    archs = _parse_archs(os.environ.get("SIMSD_CUDA_ARCHS", DEFAULT_ARCHS))

    # torch.utils.cpp_extension reads CUDA_HOME when first imported; a wrapper nvcc on PATH
    # (/usr/local/bin/nvcc -> the toolkit) would otherwise make it guess the wrong root.
    os.environ["CUDA_HOME"] = cuda_home
    from torch.utils import cpp_extension
    cpp_extension.CUDA_HOME = cuda_home
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
    # torch adds -std=c++20 (ATen needs it); no --use_fast_math: RoPE needs accurate sincosf
    nvcc_flags = ["-O3", "-lineinfo", *gencode]
    cxx_flags = ["-O3"]
    sources = ["csrc/bindings.cpp"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(CSRC, "*.cu")))
    ext = CUDAExtension(
        name="simsd_kernels._C",
        sources=sources,
        include_dirs=[CSRC],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
    info = {
        "cuda_extension": True,
        "archs": archs,
        "ptx_arch": archs[-1],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": _nvcc_version(cuda_home),
        "cuda_home": cuda_home,
        "nvcc_flags": nvcc_flags,
        "sources": sources,
        "git_sha": _git_sha(),
    }

    class BuildWithInfo(BuildExtension):
        """BuildExtension (ninja) that records what it built next to the extension."""

        def build_extensions(self):
            t0 = time.time()
            super().build_extensions()
            info["build_seconds"] = round(time.time() - t0, 1)
            info["built_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            for e in self.extensions:
                path = os.path.join(os.path.dirname(self.get_ext_fullpath(e.name)), "_build_info.json")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump(info, f, indent=1, sort_keys=True)
                _log(f"built {e.name} for sm {archs} in {info['build_seconds']} s; wrote {path}")

        def copy_extensions_to_source(self):
            # in-place / editable builds: the record goes next to the copied extension too
            super().copy_extensions_to_source()
            for e in self.extensions:
                pkg = e.name.split(".")[:-1]
                src = os.path.join(self.build_lib, *pkg, "_build_info.json")
                dst = os.path.join(ROOT, *pkg, "_build_info.json")
                if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(dst):
                    shutil.copyfile(src, dst)

    _log(f"building the CUDA extension for sm {archs} with {cuda_home} "
         f"(MAX_JOBS={os.environ.get('MAX_JOBS', 'default')})")
    return [ext], {"build_ext": BuildWithInfo.with_options(use_ninja=True)}


license_metadata = _setuptools_line()
ext_modules, cmdclass = _cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass, **license_metadata)
