"""The error and warning types of the entry points: command-line usage errors, missing optional
packages, bad request parameters, and warnings about a run."""


class UsageError(ValueError):
    """A command-line input problem (reported in one line, exit status 2)."""


class MissingPackageError(UsageError, ImportError):
    """An optional package a chosen feature needs is not installed; the message gives the
    ``pip install`` line (exit status 2 on the command line; still an ``ImportError``)."""


class ParamError(ValueError):
    """A bad request parameter (the Python API and the server): ``param`` names the field as
    the API spells it (``max_tokens``, ``prompt``, ``temperature`` ...); the HTTP server answers
    400 with it, the command line can name its option instead."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class SimsdWarning(UserWarning):
    """Something simsd runs as asked but the user should know (a draft larger than its target, a
    block length other than the checkpoint's); the command line prints it as one
    ``simsd: warning: ...`` line."""
