"""``simsd check``: every attention backend against the float64 reference on this device.

A thin front of :mod:`simsd_kernels.check` (same options, same table, ``--json`` rows); a user
with a GPU runs it first. Exit status 0 when every row passes, 1 when one fails, 2 on bad
options (``simsd: error: ...``).
"""
from __future__ import annotations

import argparse


HELP = "check every attention backend against the float64 reference on this device"


def add_check_parser(sub) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to the ``simsd`` subparsers ``sub``: its name and help line
    only. Its options come from :mod:`simsd_kernels.check`, which loads torch, so they are parsed
    once the command is known (:func:`parse_check_args`): other commands check their options
    without torch."""
    return sub.add_parser("check", help=HELP, add_help=False)


def parse_check_args(parser_class, argv: list) -> argparse.Namespace:
    """``simsd check``'s options ``argv`` (what follows ``check``), parsed by a ``parser_class``
    parser (the command line's one-line errors) with the options of :mod:`simsd_kernels.check`."""
    from simsd_kernels.check import add_arguments
    p = parser_class(prog="simsd check", description=HELP, allow_abbrev=False)
    add_arguments(p)
    return p.parse_args(argv, argparse.Namespace(command="check"))


def run_check(args) -> int:
    """Run ``simsd check``; ``ValueError`` (bad options) reaches the CLI's one-line error."""
    from simsd_kernels.check import run
    return run(args)
