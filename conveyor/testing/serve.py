"""``conveyor serve`` with ``--engine-factory``: the real stages around an engine that is not ``LLMEngine``.

    python -m conveyor.testing.serve api_server MODEL [conveyor serve api_server flags]
    python -m conveyor.testing.serve stage engine MODEL --base-port 5550 ...
    python -m conveyor.testing.serve api_server MODEL --engine-factory benchmarks.timed_engine:build

For tests and benchmarks of the service stack: the default factory is the model-free engine of
``conveyor.testing.fake_engine``. The product command has no such flag (its users serve the model
they name); the parser here is the product's (``conveyor.cli.build_parser``) with this one flag
added to the subcommands that start an engine, so every other flag means what it means there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

FAKE_ENGINE = "conveyor.testing.fake_engine:build"
ENGINE_COMMANDS = ("api_server", "stage")  # the `conveyor serve` subcommands that may start an engine


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser``'s subcommand parsers by name."""
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def build_parser() -> argparse.ArgumentParser:
    """The ``conveyor`` parser with ``--engine-factory`` on ``serve api_server`` and ``serve stage``."""
    from ..cli import build_parser as conveyor_parser

    parser = conveyor_parser()
    serve = _subcommands(_subcommands(parser)["serve"])
    for name in ENGINE_COMMANDS:
        serve[name].add_argument(
            "--engine-factory", default=FAKE_ENGINE, metavar="MODULE:CALLABLE",
            help="build the engine with this callable (model path, EngineConfig) instead of LLMEngine; the "
                 "default is a model-free engine (conveyor.testing.fake_engine); the start checks only MODEL's "
                 "path and config.json, not its weights")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``conveyor serve ARGV`` through ``build_parser``; returns the exit code."""
    from ..cli import main as conveyor_main

    return conveyor_main(["serve", *(sys.argv[1:] if argv is None else argv)], parser=build_parser())


if __name__ == "__main__":
    raise SystemExit(main())
