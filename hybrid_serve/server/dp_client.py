"""`DPClient`: `--dp-size N` scheduler replicas behind one API process, with `SchedulerClient`'s
interface, so the routes and the `Generator` do not know how many replicas there are.

Each replica is a full scheduler process with its own pools and radix cache (on CUDA replica i
takes the i-th GPU from `--device`'s; on CPU, with `--num-threads 0`, each takes an equal share of
the CPUs). Where things go:

- a request: the replica `Router` picks (`server/dp_router.py`); a session turn: the replica that
  opened the session (sessions stick; `/open_session` goes to the replica with fewest sessions);
- an abort: the replica running that rid (all of them for an unknown rid or `abort_all`);
- `flush`, `ping`, `stats`, `info`: every live replica; stats are summed (usage fractions over the
  summed pools), the leak check is clean when every live replica's is, and `info["dp"]` lists
  each replica (pid, state, requests in flight, routing tree size, its own pools and leak check).

A replica that dies after all were ready fails only its own requests, with a 503 that names it
and why ("data-parallel replica 1 failed: the scheduler process exited (killed by SIGKILL)"); the
others keep serving and take every new request, and `/health` lists it as failed. Its sessions'
turns answer 503 from then on (closing one answers 200). When the last replica dies, or one
fails before all are ready (a replica that cannot load means the server is not what was asked
for), the server stops as with one scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import replace
from typing import Any

from prometheus_client import Counter, Gauge

from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
from hybrid_serve.scheduler.messages import GenerateMsg, ReadyMsg, TokenDelta
from hybrid_serve.server.args import ServerConfig
from hybrid_serve.server.client import SchedulerClient, SchedulerError
from hybrid_serve.server.dp_router import Router, routing_key
from hybrid_serve.server.metrics import PREFIX, Metrics

logger = logging.getLogger(__name__)


def make_client(
    config: ServerConfig,
    model_path: str,
    runner_config: RunnerConfig,
    scheduler_config: SchedulerConfig,
) -> SchedulerClient | DPClient:
    """One `SchedulerClient` for `--dp-size 1` (exactly the single-scheduler server), else a
    `DPClient` over `--dp-size` of them."""
    if config.dp_size == 1:
        return SchedulerClient(model_path, runner_config, scheduler_config, config.log_level)
    return DPClient(config, model_path, runner_config, scheduler_config)


def replica_runner_config(config: RunnerConfig, rank: int, size: int) -> RunnerConfig:
    """Replica `rank`'s runner config: its own GPUs on CUDA (`--tp-size` consecutive ones
    each), its share of the CPUs on CPU (split again among its tensor-parallel ranks)."""
    device = config.device
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        device = f"cuda:{base + rank * config.tp_size}"
    threads = config.num_threads
    if threads == 0 and not os.environ.get("OMP_NUM_THREADS", "").strip():
        threads = max(1, len(os.sched_getaffinity(0)) // (size * config.tp_size))
    return replace(config, device=device, num_threads=threads)


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the replicas' stats key by key (nested dicts too); usage fractions are recomputed
    over the summed pools."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        if all(isinstance(v, dict) for v in values):
            out[key] = merge_stats(values)
        elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)
        else:
            out[key] = values[0]
    for usage, pool in (("token_usage", "kv_pages"), ("mamba_usage", "mamba_slots")):
        total = out.get(f"{pool}_total")
        if usage in out and total:
            out[usage] = 1.0 - out[f"{pool}_free"] / total
    return out


class _TrackedQueue:
    """A replica's delta queue that tells the `DPClient` when its request ends."""

    def __init__(self, inner: asyncio.Queue[TokenDelta], client: DPClient, rid: str) -> None:
        self.inner, self.client, self.rid = inner, client, rid
        self.first = True

    async def get(self) -> TokenDelta:
        d = await self.inner.get()
        if self.first and not d.error:
            self.first = False
            self.client.prompt_seen(self.rid, d.prompt_tokens, d.cached_tokens)
        if d.finish_reason or d.error:
            self.client.release(self.rid)
        return d


class DPClient:
    def __init__(
        self,
        config: ServerConfig,
        model_path: str,
        runner_config: RunnerConfig,
        scheduler_config: SchedulerConfig,
    ) -> None:
        n = config.dp_size
        self.replicas = [
            SchedulerClient(
                model_path,
                replica_runner_config(runner_config, i, n),
                scheduler_config,
                config.log_level,
                label=f"data-parallel replica {i}",
            )
            for i in range(n)
        ]
        self.router = Router(
            n,
            config.load_balance_method,
            config.cache_threshold,
            config.balance_abs_threshold,
            config.balance_rel_threshold,
            config.max_tree_size or runner_config.max_total_tokens,
        )
        self.failure: str | None = None
        self.on_failure: Any = None  # called with the message when the whole server fails
        self._where: dict[str, tuple[int, int]] = {}  # rid -> (replica, tokens counted)
        self._sessions: dict[str, int] = {}  # session id -> replica
        self._prompt = [0] * n  # prompt / cached tokens of requests started, per replica
        self._cached = [0] * n
        self._counters: dict[int, tuple[Any, Any]] = {}  # replica -> (prompt, cached) counters

    # ---- life cycle ----------------------------------------------------------------------
    def spawn(self) -> None:
        for r in self.replicas:
            r.spawn()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for i, r in enumerate(self.replicas):
            r.on_failure = lambda message, i=i: self._replica_failed(i, message)
            r.start(loop)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica at once (each joins its process; see `SchedulerClient.shutdown`)."""
        threads = [threading.Thread(target=r.shutdown, args=(timeout,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @property
    def ready(self) -> ReadyMsg | None:
        """The first live replica's `ReadyMsg` once every live replica has loaded."""
        live = [r for r in self.replicas if r.failure is None]
        if not live or any(r.ready is None for r in live):
            return None
        return live[0].ready

    @property
    def alive(self) -> bool:
        return self.failure is None and any(r.alive for r in self.replicas)

    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive]

    def _replica_failed(self, rank: int, message: str) -> None:
        self.router.forget(rank)
        live = self.live()
        if live and all(r.ready is not None for r in self.replicas):
            logger.error("%s; serving on %d of %d replicas", message, len(live), len(self.replicas))
            return
        self.failure = message
        if self.on_failure is not None:
            self.on_failure(message)

    # ---- requests ------------------------------------------------------------------------
    def submit(self, msg: GenerateMsg) -> _TrackedQueue:
        if not self.alive:
            raise SchedulerError(self.failure or "the scheduler is not running", 503)
        if msg.rid in self._where:
            raise SchedulerError(f"request id {msg.rid!r} is already in use", 400)
        rank = self._replica_for(msg)
        q = self.replicas[rank].submit(msg)
        tokens = len(msg.prompt_ids) + msg.params.max_new_tokens
        self.router.started(rank, tokens)
        self._where[msg.rid] = (rank, tokens)
        return _TrackedQueue(q, self, msg.rid)

    def _replica_for(self, msg: GenerateMsg) -> int:
        live = self.live()
        if msg.session is None:
            return self.router.pick(routing_key(msg.prompt_ids, msg.cache_salt), live)
        rank = self._sessions.get(msg.session["id"])
        if rank is None:  # not open: any replica answers that the same way
            return live[0]
        replica = self.replicas[rank]
        if not replica.alive:
            raise SchedulerError(f"this session's {replica.failure}", 503)
        return rank

    def release(self, rid: str) -> None:
        """The request ended (or its waiter left): it no longer counts as load."""
        where = self._where.pop(rid, None)
        if where is not None:
            self.router.finished(*where)

    def prompt_seen(self, rid: str, prompt_tokens: int, cached_tokens: int) -> None:
        if (where := self._where.get(rid)) is not None:
            rank = where[0]
            self._prompt[rank] += prompt_tokens
            self._cached[rank] += cached_tokens
            if rank in self._counters:
                self._counters[rank][0].inc(prompt_tokens)
                self._counters[rank][1].inc(cached_tokens)

    def abort(
        self,
        rid: str | None = None,
        abort_all: bool = False,
        forget: bool = False,
        keep_output_tokens: int | None = None,
    ) -> None:
        """As `SchedulerClient.abort`, sent to the replica running `rid` (all, if unknown)."""
        where = self._where.get(rid) if rid is not None else None
        if forget and rid is not None:
            self.release(rid)
        targets = self.replicas if where is None or abort_all else [self.replicas[where[0]]]
        for r in targets:
            r.abort(rid, abort_all, forget, keep_output_tokens)

    async def query(self, kind: str, timeout: float = 60.0, **args: Any) -> Any:
        if not self.alive:
            raise SchedulerError(self.failure or "the scheduler is not running", 503)
        if kind == "open_session":
            return await self._open_session(timeout, args)
        if kind == "close_session":
            rank = self._sessions.pop(args["session_id"], None)
            if rank is None:
                return False
            if not self.replicas[rank].alive:  # it died with its replica
                return True
            return await self.replicas[rank].query(kind, timeout, **args)
        live = self.live()
        parts = await asyncio.gather(*(self.replicas[i].query(kind, timeout, **args) for i in live))
        if kind == "flush":
            for i in live:
                self.router.forget(i)
        if kind == "stats":
            return merge_stats(parts)
        if kind == "info":
            return self._info(dict(zip(live, parts, strict=True)))
        return all(parts)

    async def _open_session(self, timeout: float, args: dict[str, Any]) -> Any:
        counts = {i: 0 for i in self.live()}
        for rank in self._sessions.values():
            if rank in counts:
                counts[rank] += 1
        rank = min(counts, key=lambda i: (counts[i], self.router.requests[i]))
        sid = await self.replicas[rank].query("open_session", timeout, **args)
        self._sessions[sid] = rank
        return sid

    def heartbeat_age(self) -> float:
        """The oldest heartbeat age among the live replicas (0 when none is live)."""
        return max((self.replicas[i].heartbeat_age() for i in self.live()), default=0.0)

    # ---- what users see ------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """One entry per replica: rank, pid, ok/loading/failed, load, routing tree size."""
        out = []
        for i, r in enumerate(self.replicas):
            state = "failed" if r.failure else "ok" if r.ready is not None else "loading"
            out.append(
                {
                    "dp_rank": i,
                    "pid": r.pid,
                    "state": state,
                    "error": r.failure,
                    "requests_in_flight": self.router.requests[i],
                    "tree_tokens": self.router.trees[i].size,
                    "sessions": sum(1 for s in self._sessions.values() if s == i),
                    "prompt_tokens": self._prompt[i],
                    "cached_tokens": self._cached[i],
                }
            )
        return out

    def _info(self, infos: dict[int, dict[str, Any]]) -> dict[str, Any]:
        first = next(iter(infos.values()))
        idle = all(info["leak_check"]["idle"] for info in infos.values())
        problems = [
            f"dp replica {i}: {p}"
            for i, info in infos.items()
            for p in info["leak_check"]["problems"] or []
        ]
        replicas = self.describe()
        for i, info in infos.items():
            replicas[i].update(pools=info["pools"], leak_check=info["leak_check"])
        return {
            "runner_config": first["runner_config"],
            "scheduler_config": first["scheduler_config"],
            "pools": merge_stats([info["pools"] for info in infos.values()]),
            "leak_check": {"idle": idle, "problems": problems if idle else None},
            "dp": replicas,
        }

    def attach_metrics(self, metrics: Metrics) -> None:
        """Per-replica series on the server's registry, read at each scrape."""

        def series(kind: type, name: str, doc: str) -> Any:
            return kind(PREFIX + name, doc, ("model_name", "dp_rank"), registry=metrics.registry)

        up = series(Gauge, "dp_replica_up", "1 while the replica serves")
        load = series(Gauge, "dp_replica_requests_in_flight", "Requests routed, unfinished")
        prompt = series(Counter, "dp_replica_prompt_tokens", "Prompt tokens routed to the replica")
        doc = "Prompt tokens the replica served from its prefix cache"
        cached = series(Counter, "dp_replica_cached_tokens", doc)
        name = metrics.model_name
        for i, r in enumerate(self.replicas):
            lab = {"model_name": name, "dp_rank": str(i)}
            up.labels(**lab).set_function(lambda r=r: float(r.alive))
            load.labels(**lab).set_function(lambda i=i: self.router.requests[i])
            self._counters[i] = (prompt.labels(**lab), cached.labels(**lab))  # fed by prompt_seen
