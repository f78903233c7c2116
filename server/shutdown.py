"""Graceful shutdown: SIGTERM (or SIGINT) drains the server instead of cutting it off.

On the first signal `DrainingServer`:
  1. refuses new work: `/health` and every new request answer 503 ("the server is shutting
     down"), and the generator submits nothing more;
  2. lets the requests in flight (running or queued) finish, for up to `--shutdown-timeout`
     seconds;
  3. then aborts the rest in the scheduler: each ends with finish reason `abort` (streams still
     send their last chunk and `data: [DONE]`, non-streaming requests get their JSON body);
  4. only then lets uvicorn shut down (close connections, lifespan shutdown: the scheduler
     process is asked to exit and joined), so the process exits 0 with no child left.
A second signal while draining falls back to uvicorn's own handling (stop now).
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 10.0  # after the abort, how long the aborted requests get to send their ends


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, timeout: float) -> None:
        super().__init__(config)
        self.state, self.timeout = state, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Steps 1-3 of the module docstring, then set `should_exit` for uvicorn."""
        state, generator = self.state, self.state.generator
        state.draining = True
        generator.closed = True
        logger.info(
            "shutting down: draining %d request(s) for up to %g s",
            generator.outstanding,
            self.timeout,
        )
        try:
            await asyncio.wait_for(generator.idle.wait(), self.timeout)
        except TimeoutError:
            logger.warning(
                "shutdown timeout: aborting %d request(s) still in flight", generator.outstanding
            )
            state.client.abort(abort_all=True)
            try:
                await asyncio.wait_for(generator.idle.wait(), ABORT_GRACE_S)
            except TimeoutError:
                logger.error("%d request(s) did not end after the abort", generator.outstanding)
        self.should_exit = True
