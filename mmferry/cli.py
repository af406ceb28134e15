"""Command line: `mmferry demo | bench`."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmferry", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run the pipeline on the bundled samples")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        print("mmferry demo: nothing to run yet")
    return 0
