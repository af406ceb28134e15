"""The implementations behind `mmferry <command>`; cli.py only parses arguments."""

from __future__ import annotations
