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
from dataclasses import MISSING, dataclass, fields
from typing import Any

from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig, opt
from hybrid_serve.server.dp_router import LOAD_BALANCE_METHODS
from hybrid_serve.server.formats import (
    REASONING_ALIASES,
    REASONING_FORMATS,
    TOOL_CALL_ALIASES,
    TOOL_CALL_FORMATS,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
CACHE_ISOLATION = ("none", "per-key")
REASONING_FLAGS = ("auto", "none", *REASONING_FORMATS, *REASONING_ALIASES)
TOOL_CALL_FLAGS = ("auto", *TOOL_CALL_FORMATS, *TOOL_CALL_ALIASES)


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP front end runs; `model_path=None` means the tiny preset in the cache dir."""

    model_path: str | None = opt(
        None, "checkpoint directory (default: the tiny preset, written on first use)"
    )
    host: str = opt("127.0.0.1", "address to bind")
    port: int = opt(30000, "port to bind")
    api_key: str | None = opt(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health and /metrics (visible "
        "in ps: prefer HYBRID_SERVE_API_KEY or --api-key-file)",
    )
    served_model_name: str | None = opt(
        None, "model name in the API (default: the checkpoint directory's name)"
    )
    log_level: str = opt("info", f"logging level: {', '.join(LOG_LEVELS)}")
    api_key_file: str | None = opt(None, "file of API keys, one per line (# comments)")
    admin_api_key: str | None = opt(
        None,
        "key for the server-wide routes (/flush_cache, abort_all); without it, one API key may "
        "use them, but with several keys /flush_cache is refused and abort_all ends the "
        "caller's own requests (also HYBRID_SERVE_ADMIN_API_KEY)",
    )
    allowed_hosts: tuple[str, ...] = opt(
        (), "Host header names accepted (default: loopback names when bound to loopback; * any)"
    )
    allowed_origins: tuple[str, ...] = opt(
        (), "browser origins allowed to call the server, with CORS (default: none)"
    )
    max_request_bytes: int = opt(
        16 * 1024 * 1024, "largest request body in bytes (larger: 413, refused while reading)"
    )
    max_header_bytes: int = opt(
        32 * 1024, "largest request head (request line and headers) in bytes; larger: 431"
    )
    timeout_header: float = opt(
        30.0,
        "seconds a connection has to deliver a request's complete headers (from opening, or "
        "from the next request's first byte on a keep-alive connection); then it is closed",
    )
    timeout_keep_alive: float = opt(
        5.0, "seconds an idle keep-alive connection stays open between requests"
    )
    max_connections: int = opt(
        2048, "open connections served at once; a request on one past this gets a fast 503"
    )
    max_queued_requests: int = opt(
        1024,
        "requests allowed to wait beyond --max-running-requests; past that new ones get 503 "
        "with Retry-After",
    )
    max_fan_out: int = opt(
        256, "most scheduler requests one HTTP request may become (prompts x n; more: 400)"
    )
    shutdown_timeout: float = opt(
        30.0,
        "seconds SIGTERM lets running requests finish before aborting the rest (they still "
        "end with a finish reason)",
    )
    health_timeout: float = opt(
        20.0, "/health answers 503 when the scheduler's loop has sent no heartbeat for this long"
    )
    cache_isolation: str = opt(
        "none",
        "per-key: every API key is its own cache_salt (no prefix cache sharing across keys)",
    )
    session_secret: str | None = opt(
        None,
        "HMAC key: /open_session answers ids carrying a tag only the opener knows, and refuses "
        "untagged ids (also HYBRID_SERVE_SESSION_SECRET)",
    )
    dp_size: int = opt(
        1,
        "data parallel: scheduler replicas behind this API process, each with its own pools "
        "and cache (hybrid_serve/server/dp_client.py)",
    )
    load_balance_method: str = opt(
        "cache_aware",
        f"how --dp-size replicas are picked: {', '.join(LOAD_BALANCE_METHODS)} "
        "(hybrid_serve/server/dp_router.py)",
    )
    cache_threshold: float = opt(
        0.3, "cache_aware: least share of the prompt a replica must hold to win on the cache"
    )
    balance_abs_threshold: int = opt(
        64,
        "cache_aware: pick the least loaded replica when the busiest has this many more "
        "requests in flight than the idlest and --balance-rel-threshold times as many",
    )
    balance_rel_threshold: float = opt(1.5, "cache_aware: see --balance-abs-threshold")
    max_tree_size: int = opt(
        0, "cache_aware: tokens each replica's routing tree keeps (0: --max-total-tokens)"
    )
    reasoning_parser: str = opt(
        "auto",
        f"chat: split <think> reasoning into reasoning_content: {', '.join(REASONING_FLAGS)} "
        "(auto: from the chat template; hybrid_serve/server/formats/)",
    )
    tool_call_parser: str = opt(
        "auto",
        f"chat: the tool call format: {', '.join(TOOL_CALL_FLAGS)} (auto: from the chat "
        "template; hybrid_serve/server/formats/)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name, choices in (
            ("cache_isolation", CACHE_ISOLATION),
            ("log_level", LOG_LEVELS),
            ("load_balance_method", LOAD_BALANCE_METHODS),
            ("reasoning_parser", REASONING_FLAGS),
            ("tool_call_parser", TOOL_CALL_FLAGS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {choices}")
        for name in ("max_request_bytes", "max_fan_out", "max_header_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0, --balance-rel-threshold >= 1")
        for name in ("max_tree_size", "max_queued_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("shutdown_timeout", "health_timeout", "timeout_header", "timeout_keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")


ALIASES: dict[str, tuple[str, ...]] = {
    "max_context_len": ("--context-length",),
    "mamba_cache_size": ("--max-mamba-cache-size",),
}

CONFIG_CLASSES = (ServerConfig, RunnerConfig, SchedulerConfig)


def _add_field(
    parser: argparse._ActionsContainer, name: str, default: Any, help: str, elem_type: type = int
) -> None:
    flags = (f"--{name.replace('_', '-')}", *ALIASES.get(name, ()))
    kwargs: dict[str, Any] = {"dest": name, "default": default, "help": help}
    if isinstance(default, bool):
        parser.add_argument(*flags, action="store_true", **kwargs)
        return
    if isinstance(default, tuple):
        kwargs.update(nargs="+", type=type(default[0]) if default else elem_type)
    elif default is not None:
        kwargs["type"] = type(default)
    if kwargs["help"] and default not in (None, ()):
        kwargs["help"] += f" (default: {default})"
    parser.add_argument(*flags, **kwargs)


def add_fields(
    group: argparse._ActionsContainer, cls: type, seen: set[str], skip: tuple[str, ...] = ()
) -> None:
    """One flag per field of the dataclass `cls` but `skip` (names kept in `seen`, so that no
    option is defined twice)."""
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name in seen:
            raise RuntimeError(f"option {f.name} is defined twice")
        seen.add(f.name)
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        elem = str if "tuple[str" in str(f.type) else int  # for empty tuple defaults
        _add_field(group, f.name, default, f.metadata.get("help", ""), elem)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of ServerConfig, RunnerConfig and SchedulerConfig."""
    seen: set[str] = set()
    for cls in CONFIG_CLASSES:
        add_fields(parser.add_argument_group(cls.__name__), cls, seen)


def config_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The parsed flags of `cls`'s fields (lists back to tuples), as its keyword arguments."""
    values = vars(args)
    kw = {f.name: values[f.name] for f in fields(cls) if f.name in values}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}


def configs_from_args(
    args: argparse.Namespace,
) -> tuple[ServerConfig, RunnerConfig, SchedulerConfig]:
    """Split parsed flags back into the three dataclasses (ValueError on bad values)."""
    out = [cls(**config_values(args, cls)) for cls in CONFIG_CLASSES]
    server, runner, _ = out
    if server.dp_size > 1 and (runner.nnodes > 1 or runner.dist_init_addr):
        raise ValueError(
            "--dp-size > 1 runs every replica on this host: it cannot be combined with "
            "--nnodes or --dist-init-addr"
        )
    return out[0], out[1], out[2]


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="hybrid-serve",
        description="Serve a hybrid Mamba/attention model over HTTP (OpenAI and SGLang APIs). "
        "Other commands: 'hybrid-serve make-model --help', 'hybrid-serve generate --help'.",
    )
    add_config_arguments(parser)
    return parser
