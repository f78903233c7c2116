"""The FastAPI app: shared state, lifespan (scheduler process up and down), auth, health, metrics.

Routes live in `openai_api.py` (/v1/...) and `native_api.py` (SGLang's /generate, sessions and
admin routes). `/health` answers 503 until the scheduler process has loaded the model, while the
server drains for shutdown, and whenever the scheduler does not answer a ping within
`--health-timeout`; otherwise 200. With `--dp-size N` the 200 carries a JSON list of the
replicas (a dead one stays listed as failed, with its error, while the others serve; 503 once
none is left: `server/dp_client.py`). Long texts are tokenized on a worker thread (`off_loop`), so
the event loop keeps answering while a big prompt is encoded.
Keys, the admin key, the Host/Origin allow-lists and JSON-only bodies: `server/security.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from scheduler.config import SchedulerConfig
from scheduler.model_runner import RunnerConfig
from server.args import ServerConfig
from server.client import SchedulerClient, SchedulerError
from server.dp_client import DPClient, make_client
from server.errors import APIError, error_response, install_error_handlers
from server.generation import Generator
from server.metrics import CONTENT_TYPE, Metrics
from server.ownership import SessionIds
from server.security import KeyCheck, Keys, RequestGuard, default_allowed_hosts

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
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
    client: SchedulerClient | DPClient
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


def create_app(
    config: ServerConfig,
    runner_config: RunnerConfig,
    scheduler_config: SchedulerConfig,
    model_path: str,
) -> FastAPI:
    """Build the app; the scheduler process starts with the app's lifespan."""
    from transformers import AutoTokenizer

    from server.native_api import router as native_router
    from server.openai_api import router as openai_router

    keys = Keys.load(config.api_key, config.api_key_file, config.admin_api_key)
    if config.cache_isolation == "per-key" and not keys.enabled:
        raise ValueError("--cache-isolation per-key needs API keys")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    name = config.served_model_name or Path(model_path).name
    client = make_client(config, model_path, runner_config, scheduler_config)
    metrics = Metrics(name)
    if isinstance(client, DPClient):
        client.attach_metrics(metrics)
    state = AppState(
        config=config,
        runner_config=runner_config,
        scheduler_config=scheduler_config,
        model_path=model_path,
        model_name=name,
        tokenizer=tokenizer,
        client=client,
        generator=Generator(
            client,
            tokenizer,
            metrics,
            max_outstanding=runner_config.max_running_requests * config.dp_size
            + config.max_queued_requests,
        ),
        metrics=metrics,
        created=int(time.time()),
        keys=keys,
        session_ids=SessionIds(
            config.session_secret or os.environ.get("HYBRID_SERVE_SESSION_SECRET") or None
        ),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            client.shutdown()
            if state.tokenize_pool is not None:
                state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="hybrid-serve", version=VERSION, lifespan=lifespan)
    app.state.hs = state
    install_error_handlers(app)

    app.add_middleware(KeyCheck, keys=keys, open_paths=OPEN_PATHS)
    # Added last = outermost: the guard answers before CORS, which answers before auth.
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    hosts = config.allowed_hosts or default_allowed_hosts(config.host)
    app.add_middleware(
        RequestGuard,
        allowed_hosts=hosts,
        allowed_origins=config.allowed_origins,
        max_body_bytes=config.max_request_bytes,
    )

    @app.get("/health")
    async def health(request: Request) -> Response:
        s = get_state(request)
        if s.draining:
            return error_response("the server is shutting down", 503)
        if s.client.ready is None or not s.client.alive:
            return error_response("the model is not loaded", 503)
        if not await s.client.ping(s.config.health_timeout):
            return error_response(
                f"the scheduler has not answered for {s.config.health_timeout:g} s", 503
            )
        if isinstance(s.client, DPClient):  # which replicas serve, which failed and why
            return JSONResponse({"dp_size": s.config.dp_size, "replicas": s.client.describe()})
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        s = get_state(request)
        if s.client.ready is not None and s.client.alive:
            try:
                s.metrics.update_gauges(await s.client.query("stats", timeout=10.0))
            except (SchedulerError, TimeoutError):
                logger.warning("metrics: scheduler stats unavailable")
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        s = get_state(request)
        return JSONResponse({"object": "list", "data": [model_card(s)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        s = get_state(request)
        if model_id != s.model_name:
            raise APIError(f"The model '{model_id}' does not exist", 404, "model")
        return JSONResponse(model_card(s))

    app.include_router(openai_router)
    app.include_router(native_router)
    return app


def model_card(s: AppState) -> dict:
    return {
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "hybrid-serve",
        "root": s.model_path,
        "max_model_len": s.runner_config.max_context_len,
    }
