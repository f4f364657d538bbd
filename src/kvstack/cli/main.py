"""`kvstack` entry point: parse the subcommand, run it, map user errors to exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType
from typing import Any, NoReturn

from kvstack.cli import bench, cache, chat, demo, estimate, evaluate, generate, serve, ui
from kvstack.errors import KvstackError
from kvstack.version import __version__

# Each module contributes `add_parser(subparsers)` (which sets `run` as a default) and
# `run(args) -> int`; a new subcommand is one more entry here.
COMMANDS: tuple[ModuleType, ...] = (generate, chat, estimate, demo, bench, serve, cache,
                                     evaluate, ui)


class UsageError(KvstackError):
    """A flag is missing, unknown or malformed."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default in --help unless it is unset (None) or a switch (False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Raises instead of printing usage and exiting, so every error ends the same way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvstack",
        description="An LLM inference engine built around KV-cache reuse.",
    )
    parser.add_argument("--version", action="version", version=f"kvstack {__version__}")
    # Subparsers are built with the parent's class, so they raise UsageError too.
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as done:  # --help and --version exit through argparse
            return done.code if isinstance(done.code, int) else 0
        return args.run(args)
    except KvstackError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; point stdout at /dev/null so that the
        # interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
