"""The error types of the command-line entry points (shared by ``generate`` and ``bench``)."""


class UsageError(ValueError):
    """A command-line input problem (reported in one line, exit status 2)."""


class MissingPackageError(UsageError, ImportError):
    """An optional package a chosen feature needs is not installed; the message gives the
    ``pip install`` line (exit status 2 on the command line; still an ``ImportError``)."""
