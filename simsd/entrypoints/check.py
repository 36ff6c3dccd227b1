"""``simsd check``: every attention backend against the float64 reference on this device.

A thin front of :mod:`simsd_kernels.check` (same options, same table, ``--json`` rows); a user
with a GPU runs it first. Exit status 0 when every row passes, 1 when one fails, 2 on bad
options (``simsd: error: ...``).
"""
from __future__ import annotations

import argparse


def add_check_parser(sub) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to the ``simsd`` subparsers ``sub``."""
    from simsd_kernels.check import add_arguments
    p = sub.add_parser("check", help="check every attention backend against the float64 reference on this device",
                       allow_abbrev=False)
    add_arguments(p)
    return p


def run_check(args) -> int:
    """Run ``simsd check``; ``ValueError`` (bad options) reaches the CLI's one-line error."""
    from simsd_kernels.check import run
    return run(args)
