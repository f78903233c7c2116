"""The soak workload: hostile-but-legal clients of the native API, for `benchmarks/soak.py` and the
bounded soak in `tests/server/test_soak.py`.

Request i of a round is one of seven kinds (i mod 7), random-token prompts of 8-300 tokens (4-40
for session turns: open sessions hold their KV), 4 to `max_new` output tokens and `ignore_eos`,
so each runs to its length unless cut:

    stream         streams to the end
    plain          one JSON answer
    leave          streams, and the client goes away after three events
    slow           streams, reading one event every 50 ms
    abort          streams, and aborts itself by rid after its first event (its rid starts with
                   `hold_prefix`: a test server can keep it running until then, however fast)
    session        a tree session: a first turn, then two turns that both branch from it, close
    stream_session a streaming (append-only) session: three streamed turns in a row, close

Every answer that completes is checked (status 200, `[DONE]` last, a finish reason that fits the
kind, as many tokens as asked when it ran to its length); a failed check is recorded, not
raised, so a round always finishes and reports. `Progress` records the longest window in which no
client saw a token while some request was in flight.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

KINDS = ("stream", "plain", "leave", "slow", "abort", "session", "stream_session")


class Progress:
    """The longest gap between two token events seen while requests were in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.last = time.monotonic()
        self.longest = 0.0
        self.tokens = 0

    def begin(self) -> None:
        with self.lock:
            if self.in_flight == 0:
                self.last = time.monotonic()
            self.in_flight += 1

    def end(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def token(self, n: int = 1) -> None:
        with self.lock:
            now = time.monotonic()
            self.longest = max(self.longest, now - self.last)
            self.last = now
            self.tokens += n


@dataclass
class RoundResult:
    requests: int = 0  # HTTP generation requests sent (a session counts each turn)
    completed: int = 0  # answers read to their end
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, completed answers
    failures: list[str] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    longest_gap_s: float = 0.0


class Client:
    def __init__(
        self,
        url: str,
        progress: Progress,
        result: RoundResult,
        timeout: float,
        max_new: int,
        hold_prefix: str = "",
    ) -> None:
        self.url, self.progress, self.result = url, progress, result
        self.timeout, self.max_new, self.hold_prefix = timeout, max_new, hold_prefix
        self.lock = threading.Lock()

    def fail(self, what: str) -> None:
        with self.lock:
            self.result.failures.append(what)

    def done(self, start: float, tokens: int) -> None:
        with self.lock:
            self.result.completed += 1
            self.result.output_tokens += tokens
            self.result.latencies.append(time.monotonic() - start)

    def generate(
        self,
        http: httpx.Client,
        body: dict,
        kind: str,
        stream: bool,
        rid: str,
    ) -> dict | None:
        """One /generate; the last answer (its meta_info) when it completed and checked out."""
        with self.lock:
            self.result.requests += 1
        start = time.monotonic()
        self.progress.begin()
        try:
            return self._generate(http, body, kind, stream, rid, start)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            self.fail(f"{rid} ({kind}): {type(e).__name__}: {e}")
            return None
        finally:
            self.progress.end()

    def _generate(
        self, http: httpx.Client, body: dict, kind: str, stream: bool, rid: str, start: float
    ) -> dict | None:
        want = body["sampling_params"]["max_new_tokens"]
        if not stream:
            r = http.post("/generate", json=body)
            out = r.json()
            self.progress.token(len(out.get("output_ids", [])))
            if r.status_code != 200 or out["meta_info"]["finish_reason"]["type"] != "length":
                self.fail(f"{rid} ({kind}): {r.status_code} {str(out)[:200]}")
                return None
            if len(out["output_ids"]) != want:
                self.fail(f"{rid} ({kind}): {len(out['output_ids'])} tokens, asked {want}")
            self.done(start, len(out["output_ids"]))
            return out
        events: list[str] = []
        n_tokens = 0
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                self.fail(f"{rid} ({kind}): status {r.status_code}")
                return None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if line != "data: [DONE]":
                    got = len(json.loads(line[6:]).get("output_ids", []))
                    n_tokens = max(n_tokens, got)  # cumulative output_ids per event
                    self.progress.token()
                if kind == "leave" and len(events) == 3:
                    return None  # gone mid-stream
                if kind == "slow":
                    time.sleep(0.05)
                if kind == "abort" and len(events) == 1:
                    if http.post("/abort_request", json={"rid": rid}).status_code != 200:
                        self.fail(f"{rid}: /abort_request refused")
        if len(events) < 2 or events[-1] != "data: [DONE]":
            self.fail(f"{rid} ({kind}): stream ended without [DONE]: {events[-2:]}")
            return None
        last = json.loads(events[-2][6:])
        reason = last.get("meta_info", {}).get("finish_reason", {}).get("type")
        allowed = ("length", "abort") if kind == "abort" else ("length",)
        if reason not in allowed:
            self.fail(f"{rid} ({kind}): finish reason {reason}: {str(last)[:200]}")
            return None
        if reason == "length" and n_tokens != want:
            self.fail(f"{rid} ({kind}): {n_tokens} tokens, asked {want}")
        self.done(start, n_tokens)
        return last

    def run(self, i: int, seed: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        kind = KINDS[i % len(KINDS)]
        with self.lock:
            self.result.kinds[kind] = self.result.kinds.get(kind, 0) + 1

        def body(rid: str, session: dict | None = None, short: bool = False) -> dict:
            n = rng.randrange(4, 40) if short else rng.randrange(8, 300)
            params = {
                "max_new_tokens": rng.randrange(4, self.max_new + 1),
                "temperature": 0.7,
                "sampling_seed": rng.randrange(1 << 30),
                "ignore_eos": True,
            }
            out = {
                "input_ids": [rng.randrange(3, 1000) for _ in range(n)],
                "sampling_params": params,
                "rid": rid,
            }
            if session is not None:
                out["session_params"] = session
            return out

        rid = f"{self.hold_prefix if kind == 'abort' else ''}soak{seed}-{i}"
        with httpx.Client(base_url=self.url, timeout=self.timeout) as http:
            if kind in ("stream", "plain", "leave", "slow", "abort"):
                self.generate(http, body(rid), kind, kind != "plain", rid)
            elif kind == "session":
                self.tree_session(http, rid, body)
            else:
                self.streaming_session(http, rid, body)

    def open(self, http: httpx.Client, rid: str, streaming: bool) -> str | None:
        r = http.post("/open_session", json={"streaming": streaming})
        if r.status_code != 200:
            self.fail(f"{rid}: /open_session {r.status_code} {r.text[:200]}")
            return None
        return r.json()

    def close(self, http: httpx.Client, rid: str, sid: str) -> None:
        r = http.post("/close_session", json={"session_id": sid})
        if r.status_code != 200:
            self.fail(f"{rid}: /close_session {r.status_code} {r.text[:200]}")

    def tree_session(self, http: httpx.Client, rid: str, body) -> None:
        sid = self.open(http, rid, streaming=False)
        if sid is None:
            return
        t0 = body(f"{rid}-t0", {"id": sid}, short=True)
        first = self.generate(http, t0, "session", False, f"{rid}-t0")
        if first is not None:
            for b in (1, 2):  # two branches off the first turn
                turn = f"{rid}-t{b}"
                session = {"id": sid, "rid": f"{rid}-t0"}
                self.generate(http, body(turn, session, short=True), "session", False, turn)
        self.close(http, rid, sid)

    def streaming_session(self, http: httpx.Client, rid: str, body) -> None:
        sid = self.open(http, rid, streaming=True)
        if sid is None:
            return
        for t in range(3):  # short turns: three of them fit a 512-token context
            turn = f"{rid}-t{t}"
            if self.generate(http, body(turn, {"id": sid}, True), "session", True, turn) is None:
                break
        self.close(http, rid, sid)


def run_round(
    url: str,
    n_requests: int,
    n_clients: int,
    seed: int,
    max_new: int = 48,
    timeout: float = 120.0,
    hold_prefix: str = "",
) -> RoundResult:
    """`n_requests` workload items (kinds in turn) from `n_clients` threads, each request asking
    for 4 to `max_new` tokens; returns when all have finished. The abort kind's rids start with
    `hold_prefix`."""
    result = RoundResult()
    progress = Progress()
    client = Client(url, progress, result, timeout, max_new, hold_prefix)
    t0 = time.monotonic()
    with ThreadPoolExecutor(n_clients) as pool:
        list(pool.map(lambda i: client.run(i, seed), range(n_requests)))
    result.wall_s = time.monotonic() - t0
    result.longest_gap_s = progress.longest
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]
