"""argparse help formatting shared by the ``simsd`` commands (``cli`` and ``serve`` both use it)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: ``(default: X)`` unless the text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and "default" not in text
                and action.default not in (None, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text
