"""The error and warning types of the entry points: refused settings (:class:`ParamError`, one
type for every surface), missing optional packages, and warnings about a run."""
from ..config.vocabulary import ParamError  # noqa: F401  (re-exported: simsd.ParamError)


class MissingPackageError(ValueError, ImportError):
    """An optional package a chosen feature needs is not installed; the message gives the
    ``pip install`` line (exit status 2 on the command line; still an ``ImportError``)."""


class SimsdWarning(UserWarning):
    """Something simsd runs as asked but the user should know (a draft larger than its target, a
    block length other than the checkpoint's); the command line prints it as one
    ``simsd: warning: ...`` line."""
