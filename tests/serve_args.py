"""The server's command line parsed the way `hybrid-serve` parses it (`server/cli.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_serve.server.args import build_serve_parser, configs_from_args

if TYPE_CHECKING:
    from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
    from hybrid_serve.server.args import ServerConfig


def parse_serve_args(argv: list[str]) -> tuple[ServerConfig, RunnerConfig, SchedulerConfig]:
    """The three configs of the flags `argv`; argparse's `SystemExit` on an unknown flag or a bad
    choice, `ValueError` on values the configs refuse."""
    return configs_from_args(build_serve_parser().parse_args(argv))
