"""The implementations behind `mmferry <command>`; cli.py only parses arguments."""

from __future__ import annotations

import argparse

# Longest piece of a user's or client's text (a path, a URL) quoted back in a message.
QUOTE_LIMIT = 160


class UsageError(Exception):
    """A user mistake (a bad option value, a folder that is not a checkpoint): `mmferry` prints
    it as one line on stderr and exits 2, without a traceback."""


def quoted(text: object, limit: int = QUOTE_LIMIT) -> str:
    """`text` as repr, cut to `limit` characters with the cut marked."""
    s = repr(str(text))
    return s if len(s) <= limit else s[: limit - 4] + "...'"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        if isinstance(action.default, (list, tuple)) and not action.default:
            return text
        return super()._get_help_string(action)
