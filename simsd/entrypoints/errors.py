"""The error type of the command-line entry points (shared by ``generate`` and ``bench``)."""


class UsageError(ValueError):
    """A command-line input problem (reported in one line, exit status 2)."""
