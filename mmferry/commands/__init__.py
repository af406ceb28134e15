"""The implementations behind `mmferry <command>`; cli.py only parses arguments."""

from __future__ import annotations

import argparse
from typing import NoReturn

# Longest piece of a user's or client's text (a path, a URL) quoted back in a message.
QUOTE_LIMIT = 160


class UsageError(Exception):
    """A user mistake (a bad option value, a folder that is not a checkpoint): `mmferry` prints
    it as one line on stderr and exits 2, without a traceback."""


def quoted(text: object, limit: int = QUOTE_LIMIT) -> str:
    """`text` as repr, cut to `limit` characters with the cut marked."""
    s = repr(str(text))
    return s if len(s) <= limit else s[: limit - 4] + "...'"


def short(text: object, limit: int = QUOTE_LIMIT) -> str:
    """`text` as it is when short and printable, else `quoted`: bounded, escapes shown."""
    s = str(text)
    return s if len(s) <= limit and s.isprintable() else quoted(s, limit)


def positive_int(text: str) -> int:
    """argparse type of a count of at least 1 (threads, items)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {quoted(text, 40)}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # NOTE: by identity: a default of 0 or 0.0 is shown (0 == False).
        none = action.default is None or action.default is False
        if none or action.default == argparse.SUPPRESS or "%(default)" in text:
            return text
        if isinstance(action.default, (list, tuple)) and not action.default:
            return text
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """A command's parser: a mistake is a one-line usage and one line saying what is wrong
    (the full usage of `serve` runs to a screen, which buries the error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            2, f"usage: {self.prog} [options] (--help lists them)\n{self.prog}: error: {message}\n"
        )
