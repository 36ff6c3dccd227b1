"""What the Ray entry points share (docs/scaling.md): the check that Ray is installed, the
connection to a Ray cluster, and the resources one LLM (a Ray Data worker, a Ray Serve replica)
asks Ray for. Ray is an optional extra (``pip install 'simsd[ray]'``), imported only here and in
:mod:`~simsd.entrypoints.ray_data` / :mod:`~simsd.entrypoints.ray_serve`, only with ``--ray``."""
from __future__ import annotations

import importlib
import logging

from .errors import MissingPackageError


def require_ray(module: str) -> None:
    """Import ``module`` (``ray.data``, ``ray.serve``) or raise :class:`MissingPackageError`
    (one line: the missing package and ``pip install 'simsd[ray]'``)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing = (exc.name or module).split(".")[0]
        raise MissingPackageError(f"--ray needs Ray's {module.split('.')[-1]} library ({missing} is not "
                                  f"installed): pip install 'simsd[ray]'") from None


class _Quiet(logging.Filter):
    """Drops the notices Ray logs on every run that need nothing from the user (a local cluster
    starting with token authentication on, as Ray's secure default; progress bars off, as simsd
    asks); every other record, Ray's warning that token authentication is *off* among them,
    passes."""
    NOTICES = ("Token authentication is enabled for this Ray cluster", "Progress bars disabled")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTICES)


def init_ray() -> None:
    """Connect to Ray unless this process already is: the cluster of ``RAY_ADDRESS`` (e.g. a
    cluster started by ``ray start --head``), else a local instance of this machine's CPUs and
    GPUs. The workers' and replicas' own output stays in Ray's logs (their errors come back as
    exceptions); of the driver's, Ray's per-run notices are dropped (:class:`_Quiet`)."""
    import ray
    for name in ("ray._private.authentication.authentication_token_setup", "ray.data._internal.progress"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Quiet) for f in logger.filters):
            logger.addFilter(_Quiet())
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)


def llm_resources(config) -> dict:
    """``{"num_cpus", "num_gpus"}`` of one LLM of ``config`` (:class:`EngineArgs`): its CPU
    threads (``threads``, else 1) and one GPU per CUDA device it names (target and draft; the
    default device is CUDA when the caller sees one). Ray then sets the actor's
    ``CUDA_VISIBLE_DEVICES``, so ``cuda`` is the GPU Ray placed it on."""
    import torch
    default = "cuda" if torch.cuda.is_available() else "cpu"
    names = [config.device] + ([config.draft_device] if config.mode != "vanilla" and config.draft_device else [])
    cuda = {torch.device(d or default).index or 0 for d in names if torch.device(d or default).type == "cuda"}
    return {"num_cpus": config.threads or 1, "num_gpus": len(cuda)}
