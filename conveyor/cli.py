"""The ``conveyor`` command line: one argparse subcommand per concern (``list`` for now)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from conveyor.services.chat_template import list_chat_templates


def _cmd_list(args: argparse.Namespace) -> int:
    """Print the built-in chat template names, one per line."""
    for name in list_chat_templates():
        print(name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand sets ``func`` to its handler (args -> exit code)."""
    parser = argparse.ArgumentParser(prog="conveyor", description="Serve large language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p_list = sub.add_parser("list", help="list the built-in chat template names")
    p_list.set_defaults(func=_cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``conveyor`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
