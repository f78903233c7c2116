"""The FastAPI app: the scheduler process (spawned with the app, attached and stopped by its
lifespan), middleware, health, metrics.

Routes live in `openai_api.py` and `chat_api.py` (/v1/...) and `native_api.py` (SGLang's
/generate, sessions and admin routes). `/health` answers 503 until the model is loaded, while the
server drains, and whenever the scheduler's last heartbeat is older than `--health-timeout` (from
its age, never by waiting on the scheduler); otherwise 200, with `--dp-size N` a JSON list of the
replicas (a dead one listed as failed, with its error, while the others serve:
`hybrid_serve/server/dp_client.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
from hybrid_serve.server.app_state import VERSION, AppState, get_state
from hybrid_serve.server.args import ServerConfig
from hybrid_serve.server.chat_api import router as chat_router
from hybrid_serve.server.client import SchedulerError
from hybrid_serve.server.dp_client import DPClient, make_client
from hybrid_serve.server.errors import APIError, error_response, install_error_handlers
from hybrid_serve.server.generation import Generator
from hybrid_serve.server.metrics import CONTENT_TYPE, Metrics
from hybrid_serve.server.native_api import router as native_router
from hybrid_serve.server.openai_api import router as openai_router
from hybrid_serve.server.ownership import SessionIds
from hybrid_serve.server.security import KeyCheck, Keys, RequestGuard, default_allowed_hosts

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})


def create_app(
    config: ServerConfig,
    runner_config: RunnerConfig,
    scheduler_config: SchedulerConfig,
    model_path: str,
) -> FastAPI:
    """Build the app. The scheduler process is spawned first, so that it loads the model while
    this process imports and loads the tokenizer; the app's lifespan attaches it to the event
    loop and stops it."""
    state = build_state(config, runner_config, scheduler_config, model_path)
    client = state.client

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
    add_middleware(app, config, state.keys)
    app.include_router(router)
    app.include_router(openai_router)
    app.include_router(chat_router)
    app.include_router(native_router)
    return app


def build_state(
    config: ServerConfig,
    runner_config: RunnerConfig,
    scheduler_config: SchedulerConfig,
    model_path: str,
) -> AppState:
    """The app's state, its scheduler process spawned (not yet attached) and the tokenizer
    loaded; a failure to load the tokenizer shuts the scheduler process down again. `ValueError`
    for `--cache-isolation per-key` without API keys, before anything is spawned."""
    keys = Keys.load(config.api_key, config.api_key_file, config.admin_api_key)
    if config.cache_isolation == "per-key" and not keys.enabled:
        raise ValueError("--cache-isolation per-key needs API keys")
    client = make_client(config, model_path, runner_config, scheduler_config)
    client.spawn()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except BaseException:
        client.shutdown(timeout=0)
        raise
    name = config.served_model_name or Path(model_path).name
    metrics = Metrics(name)
    if isinstance(client, DPClient):
        client.attach_metrics(metrics)
    return AppState(
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


def add_middleware(app: FastAPI, config: ServerConfig, keys: Keys) -> None:
    """API keys innermost, then CORS (with `--allowed-origins`), then the request guard (hosts,
    origins, body size) outermost: the guard answers before CORS, which answers before auth."""
    app.add_middleware(KeyCheck, keys=keys, open_paths=OPEN_PATHS)
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


# health, metrics and the model list; the API routes are in the routers of the *_api modules
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    s = get_state(request)
    if s.draining:
        return error_response("the server is shutting down", 503)
    if s.client.ready is None or not s.client.alive:
        return error_response("the model is not loaded", 503)
    age = s.client.heartbeat_age()
    if age > s.config.health_timeout:
        return error_response(f"the scheduler has not been heard from for {age:.1f} s", 503)
    if isinstance(s.client, DPClient):  # which replicas serve, which failed and why
        return JSONResponse({"dp_size": s.config.dp_size, "replicas": s.client.describe()})
    return Response(status_code=200)


@router.get("/metrics")
async def metrics_route(request: Request) -> Response:
    s = get_state(request)
    if s.client.ready is not None and s.client.alive:
        try:
            s.metrics.update_gauges(await s.client.query("stats", timeout=10.0))
        except (SchedulerError, TimeoutError):
            logger.warning("metrics: scheduler stats unavailable")
    return Response(s.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    s = get_state(request)
    return JSONResponse({"object": "list", "data": [model_card(s)]})


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> JSONResponse:
    s = get_state(request)
    if model_id != s.model_name:
        raise APIError(f"The model '{model_id}' does not exist", 404, "model")
    return JSONResponse(model_card(s))


def model_card(s: AppState) -> dict:
    return {
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "hybrid-serve",
        "root": s.model_path,
        "max_model_len": s.runner_config.max_context_len,
    }
