"""The FastAPI app: shared state, lifespan (scheduler process up and down), auth, health, metrics.

Routes live in `openai_api.py` (/v1/...) and `native_api.py` (SGLang's /generate, sessions and
admin routes). `/health` answers 503 until the scheduler process has loaded the model, then 200.
Keys, the admin key, the Host/Origin allow-lists and JSON-only bodies: `server/security.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
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
from server.errors import APIError, error_response, install_error_handlers
from server.generation import Generator
from server.metrics import CONTENT_TYPE, Metrics
from server.ownership import SessionIds
from server.security import KeyCheck, Keys, RequestGuard, default_allowed_hosts

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
    keys: Keys
    session_ids: SessionIds

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
    app.add_middleware(RequestGuard, allowed_hosts=hosts, allowed_origins=config.allowed_origins)

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
