"""The FastAPI app: shared state, lifespan (scheduler process up and down), auth, health, metrics.

Routes live in `openai_api.py` (/v1/...) and `native_api.py` (SGLang's /generate, sessions and
admin routes). `/health` answers 503 until the scheduler process has loaded the model, then 200.
With an API key every route but /health and /metrics wants `Authorization: Bearer KEY` (401).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from scheduler.config import SchedulerConfig
from scheduler.model_runner import RunnerConfig
from server.args import ServerConfig
from server.client import SchedulerClient, SchedulerError
from server.errors import APIError, error_response, install_error_handlers
from server.generation import Generator
from server.metrics import CONTENT_TYPE, Metrics

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
VERSION = "0.1.0"


@dataclass
class AppState:
    config: ServerConfig
    runner_config: RunnerConfig
    scheduler_config: SchedulerConfig
    model_path: str
    model_name: str
    tokenizer: Any
    client: SchedulerClient
    generator: Generator
    metrics: Metrics
    created: int

    def check_model(self, name: str | None) -> None:
        """404 unless `name` is the served model's name (or 'default')."""
        if name not in (self.model_name, "default"):
            raise APIError(f"The model '{name}' does not exist", 404, "model")

    def check_ready(self) -> None:
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


class JSONBodyByDefault:
    """Read a body sent without a JSON content type (`curl -d` sends a form type) as JSON."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = dict(scope["headers"]).get(b"content-type", b"")
            if not given or given.startswith(b"application/x-www-form-urlencoded"):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


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

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    name = config.served_model_name or Path(model_path).name
    client = SchedulerClient(model_path, runner_config, scheduler_config, config.log_level)
    metrics = Metrics(name)
    state = AppState(
        config=config,
        runner_config=runner_config,
        scheduler_config=scheduler_config,
        model_path=model_path,
        model_name=name,
        tokenizer=tokenizer,
        client=client,
        generator=Generator(client, tokenizer, metrics),
        metrics=metrics,
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            client.shutdown()

    app = FastAPI(title="hybrid-serve", version=VERSION, lifespan=lifespan)
    app.state.hs = state
    install_error_handlers(app)
    app.add_middleware(JSONBodyByDefault)

    if config.api_key:
        expected = f"Bearer {config.api_key}"

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path not in OPEN_PATHS:
                given = request.headers.get("authorization", "")
                if not secrets.compare_digest(given.encode(), expected.encode()):
                    return error_response("invalid or missing API key", 401)
            return await call_next(request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        s = get_state(request)
        if s.client.ready is None or not s.client.alive:
            return error_response("the model is not loaded", 503)
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
