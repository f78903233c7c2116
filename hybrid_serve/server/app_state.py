"""`AppState`: what every route shares (configs, tokenizer, scheduler client, generator,
metrics, keys), kept on `app.state.hs` by `hybrid_serve/server/http_server.py`'s `create_app`.

Routes (`openai_api.py`, `chat_api.py`, `native_api.py`) import this module, never
`http_server`, which imports them to build the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
from hybrid_serve.server.args import ServerConfig
from hybrid_serve.server.client import SchedulerClient, SchedulerError
from hybrid_serve.server.dp_client import DPClient
from hybrid_serve.server.errors import APIError
from hybrid_serve.server.generation import Generator
from hybrid_serve.server.metrics import Metrics
from hybrid_serve.server.ownership import SessionIds
from hybrid_serve.server.security import Keys

VERSION = "0.1.0"
OFF_LOOP_CHARS = 4096  # texts at least this long are tokenized on the worker thread


@dataclass
class AppState:
    config: ServerConfig
    runner_config: RunnerConfig
    scheduler_config: SchedulerConfig
    model_path: str
    model_name: str
    tokenizer: Any
    client: SchedulerClient | DPClient  # DPClient with --dp-size > 1
    generator: Generator
    metrics: Metrics
    created: int
    keys: Keys
    session_ids: SessionIds
    draining: bool = False  # SIGTERM: new requests get 503 while running ones finish
    # One thread: the tokenizer is used from one worker at a time (fast tokenizers are not
    # safe to share between threads), and CPU-heavy encodes queue instead of piling up.
    tokenize_pool: ThreadPoolExecutor | None = None

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """`fn(*args, **kw)` on the tokenizer thread, awaited without blocking the loop."""
        if self.tokenize_pool is None:
            self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenize_pool, lambda: fn(*args, **kw)
        )

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens); long texts off the event loop."""
        if len(text) < OFF_LOOP_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return await self.off_loop(self.tokenizer.encode, text, add_special_tokens=False)

    def check_fan_out(self, count: int) -> None:
        """400 when one HTTP request would become more than `--max-fan-out` requests."""
        if count > self.config.max_fan_out:
            raise APIError(
                f"this request asks for {count} generations (prompts x n); the limit is "
                f"{self.config.max_fan_out} (--max-fan-out)",
                400,
                "n",
            )

    def check_model(self, name: str | None) -> None:
        """404 unless `name` is the served model's name (or 'default')."""
        if name not in (self.model_name, "default"):
            raise APIError(f"The model '{name}' does not exist", 404, "model")

    def check_ready(self) -> None:
        if self.draining:
            raise APIError("the server is shutting down", 503)
        if self.client.failure is not None:
            raise APIError(f"the scheduler failed: {self.client.failure}", 503)
        if self.client.ready is None:
            raise APIError("the model is still loading", 503)

    async def query(self, kind: str, **args: Any) -> Any:
        self.check_ready()
        try:
            return await self.client.query(kind, **args)
        except SchedulerError as e:
            raise APIError(str(e), e.status) from e


def get_state(request: Request) -> AppState:
    return request.app.state.hs
