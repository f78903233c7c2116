"""Server options: `ServerConfig` plus the command line generated from three frozen dataclasses.

    hybrid-serve [--model-path DIR] [--host H] [--port P] [--api-key K] [--served-model-name N]
                 [every RunnerConfig / SchedulerConfig field as --flag-name]

Each dataclass field `some_name` becomes `--some-name` (SGLang's spelling); a few fields also
answer to SGLang's own flag where our field name differs (`--context-length` for
`max_context_len`, `--max-mamba-cache-size` for `mamba_cache_size`). Booleans are switches,
tuples take several values. Values are validated by the dataclasses' `__post_init__`.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from scheduler.config import SchedulerConfig
from scheduler.model_runner import RunnerConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP front end runs; `model_path=None` means the tiny preset in the cache dir."""

    model_path: str | None = _opt(
        None, "checkpoint directory (default: the tiny preset, written on first use)"
    )
    host: str = _opt("127.0.0.1", "address to bind")
    port: int = _opt(30000, "port to bind")
    api_key: str | None = _opt(
        None, "require 'Authorization: Bearer KEY' on every route but /health and /metrics"
    )
    served_model_name: str | None = _opt(
        None, "model name in the API (default: the checkpoint directory's name)"
    )
    log_level: str = _opt("info", f"logging level: {', '.join(LOG_LEVELS)}")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}")


# Help for the scheduler's dataclasses (ServerConfig carries its own in field metadata).
HELP: dict[str, str] = {
    "max_running_requests": "requests decoded together (rows of req_to_token)",
    "max_total_tokens": "KV cache capacity in tokens",
    "max_context_len": "longest sequence (prompt + output) in tokens",
    "page_size": "tokens per KV page",
    "mamba_cache_size": "Mamba state slots (0: sized from the strategy and max running requests)",
    "dtype": "weights and activations dtype (auto: the checkpoint's)",
    "device": "cpu or cuda",
    "num_threads": "torch CPU threads (0: OMP_NUM_THREADS if set, else the CPUs this process "
    "may use)",
    "max_prefill_tokens": "new tokens in one prefill batch",
    "chunked_prefill_size": "max new tokens of one request per prefill round (<= 0: no chunking)",
    "schedule_policy": "waiting queue order: fcfs or lpm (longest prefix match)",
    "disable_radix_cache": "turn prefix caching off",
    "mamba_scheduler_strategy": "when Mamba states are snapshotted for the radix cache",
    "mamba_track_interval": "decode tokens between Mamba state snapshots (extra_buffer*)",
    "cuda_graph_bs": "decode batch sizes (batches are padded up to one of them)",
    "cuda_graph_max_bs": "largest padded decode size (CUDA graphs captured up to it)",
    "disable_cuda_graph": "run decode batches at their own size",
}

ALIASES: dict[str, tuple[str, ...]] = {
    "max_context_len": ("--context-length",),
    "mamba_cache_size": ("--max-mamba-cache-size",),
}

CONFIG_CLASSES = (ServerConfig, RunnerConfig, SchedulerConfig)


def _add_field(parser: argparse._ActionsContainer, name: str, default: Any, help: str) -> None:
    flags = (f"--{name.replace('_', '-')}", *ALIASES.get(name, ()))
    kwargs: dict[str, Any] = {"dest": name, "default": default, "help": help}
    if isinstance(default, bool):
        parser.add_argument(*flags, action="store_true", **kwargs)
        return
    if isinstance(default, tuple):
        kwargs.update(nargs="+", type=type(default[0]) if default else int)
    elif default is not None:
        kwargs["type"] = type(default)
    if kwargs["help"] and default not in (None, ()):
        kwargs["help"] += f" (default: {default})"
    parser.add_argument(*flags, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of ServerConfig, RunnerConfig and SchedulerConfig."""
    seen: set[str] = set()
    for cls in CONFIG_CLASSES:
        group = parser.add_argument_group(cls.__name__)
        for f in fields(cls):
            if f.name in seen:
                raise RuntimeError(f"option {f.name} is defined twice")
            seen.add(f.name)
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            _add_field(group, f.name, default, f.metadata.get("help") or HELP.get(f.name, ""))


def configs_from_args(
    args: argparse.Namespace,
) -> tuple[ServerConfig, RunnerConfig, SchedulerConfig]:
    """Split parsed flags back into the three dataclasses (ValueError on bad values)."""
    values = vars(args)
    out = []
    for cls in CONFIG_CLASSES:
        kw = {f.name: values[f.name] for f in fields(cls) if f.name in values}
        for k, v in kw.items():
            if isinstance(v, list):
                kw[k] = tuple(v)
        out.append(cls(**kw))
    return out[0], out[1], out[2]


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-serve",
        description="Serve a hybrid Mamba/attention model over HTTP (OpenAI and SGLang APIs). "
        "Other commands: 'hybrid-serve make-model --help', 'hybrid-serve generate --help'.",
    )
    add_config_arguments(parser)
    return parser


def parse_serve_args(
    argv: list[str] | None = None,
) -> tuple[ServerConfig, RunnerConfig, SchedulerConfig]:
    return configs_from_args(build_serve_parser().parse_args(argv))
