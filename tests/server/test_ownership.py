"""Issue 14's probes on sessions and request ids, which must now fail to get in: a second key
continuing, branching, closing or probing another key's session, a second key aborting (or
taking first) another key's request id, a keyless caller using a session id it did not open
under `--session-secret`, the PIN-guess probe on the prefix cache under two `cache_salt`s and
under `--cache-isolation per-key`; a second key stopping the first's requests with `abort_all` or
emptying the shared cache with /flush_cache (issue 46); plus session timeouts and
`--max-sessions`."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import HELD, HOLD_ENV, start, wait_idle_and_clean

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
# states every 64-token chunk, so a prompt sharing 128 tokens with a cached one hits 128
TRACKED = ["--mamba-scheduler-strategy", "extra_buffer", "--mamba-track-interval", "4"]
PRE, POST = list(range(10, 110)), list(range(120, 160))
SECRET, WRONG = PRE + [77] + POST, PRE + [78] + POST  # "the PIN is 77"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def two_keys(tiny_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ownership")
    (tmp / "keys").write_text("alice-key\nbob-key\n")
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path), *TRACKED]
    cmd += ["--api-key-file", str(tmp / "keys"), "--max-sessions", "3"]
    srv = start([*cmd, "--cache-isolation", "per-key"], tmp / "log", HOLD_ENV)
    try:
        srv.wait_healthy()
        with (
            httpx.Client(base_url=srv.url, headers=_auth("alice-key"), timeout=60) as alice,
            httpx.Client(base_url=srv.url, headers=_auth("bob-key"), timeout=60) as bob,
        ):
            yield alice, bob
    finally:
        assert srv.stop(signal.SIGTERM) == 0


def _turn(c: httpx.Client, ids: list[int], **session) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": GREEDY}
    return c.post("/generate", json={**body, "session_params": session} if session else body)


def test_a_second_key_cannot_reach_a_session(two_keys):
    alice, bob = two_keys
    assert alice.post("/open_session", json={"session_id": "alice-chat"}).json() == "alice-chat"
    first = _turn(alice, [5, 6, 7, 8, 9], id="alice-chat")
    assert first.status_code == 200, first.text
    turn1 = first.json()["meta_info"]["id"]
    # continue (inject), branch from alice's turn, close: all 404, as for an absent session
    for r in (
        _turn(bob, [11, 12], id="alice-chat"),
        _turn(bob, [11, 12], id="alice-chat", rid=turn1, replace=True),
        bob.post("/close_session", json={"session_id": "alice-chat"}),
    ):
        assert r.status_code == 404 and "/" not in r.json()["message"], r.text  # no scoping
    absent = bob.post("/close_session", json={"session_id": "nobody-chat"})
    assert absent.status_code == 404 and absent.json()["message"].replace(
        "nobody", "alice"
    ) == r.json()["message"].replace("nobody", "alice")
    # opening the same id is no probe: bob gets a session of his own, alice's is untouched
    assert bob.post("/open_session", json={"session_id": "alice-chat"}).json() == "alice-chat"
    assert _turn(bob, [11, 12, 13], id="alice-chat").status_code == 200
    again = alice.post("/open_session", json={"session_id": "alice-chat"})
    assert again.status_code == 400  # alice's own id is still open
    assert again.json()["message"] == "session 'alice-chat' is already open"
    second = _turn(alice, [21, 22], id="alice-chat", rid=turn1).json()["meta_info"]
    assert second["prompt_tokens"] == 5 + 4 + 2  # her turn, her output, nothing of bob's
    assert second["cached_tokens"] == 5 + 4 - 1  # continued from her held state
    # one more session fills --max-sessions (3): a clear 429
    assert alice.post("/open_session", json={}).status_code == 200
    full = bob.post("/open_session", json={})
    assert full.status_code == 429 and "max-sessions" in full.json()["message"]
    for c in (alice, bob):
        assert c.post("/close_session", json={"session_id": "alice-chat"}).status_code == 200
    assert wait_idle_and_clean(alice)["problems"] == []


def test_a_second_key_cannot_abort_or_take_a_request_id(two_keys):
    alice, bob = two_keys
    body = {"input_ids": [3, 4, 5], "rid": "alice-job", "stream": True}
    body["sampling_params"] = {**GREEDY, "max_new_tokens": 400}

    def last_event(lines, abort_after: int | None = None) -> dict:
        events = []
        for line in lines:
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
                if len(events) == abort_after:  # alice aborts her own request by its id
                    alice.post("/abort_request", json={"rid": "alice-job"}).raise_for_status()
        return events[-1]["meta_info"]

    with alice.stream("POST", "/generate", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        # bob's abort names nothing of his; the same rid is free for him (nothing to take)
        assert bob.post("/abort_request", json={"rid": "alice-job"}).status_code == 200
        mine = bob.post("/generate", json={**body, "stream": False, "sampling_params": GREEDY})
        assert mine.status_code == 200 and mine.json()["meta_info"]["id"] == "alice-job"
        assert mine.json()["meta_info"]["finish_reason"]["type"] == "length"
        last = last_event(lines)
    assert last["id"] == "alice-job" and last["completion_tokens"] == 400  # ran to its end
    with alice.stream("POST", "/generate", json=body) as stream:
        last = last_event(stream.iter_lines(), abort_after=3)
    assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 400
    assert wait_idle_and_clean(alice)["problems"] == []


def _events(lines) -> Iterator[dict]:
    for line in lines:
        if line.startswith("data:") and line != "data: [DONE]":
            yield json.loads(line[5:])


def test_a_second_key_cannot_stop_or_flush_the_first(two_keys):
    """Several keys, no admin key: bob's abort_all ends bob's requests only, his abort of
    alice's rid ends nothing, and /flush_cache (server-wide) is a 403 naming --admin-api-key."""
    alice, bob = two_keys
    sp = {**GREEDY, "max_new_tokens": 16}
    held = {"input_ids": [6, 7, 8], "stream": True, "sampling_params": sp}  # paused at 2 outputs
    long = {"input_ids": [3, 4, 5], "rid": "alice-long", "stream": True}
    long["sampling_params"] = {**GREEDY, "max_new_tokens": 400}
    with (
        alice.stream("POST", "/generate", json=long) as a_long,
        alice.stream("POST", "/generate", json={**held, "rid": HELD + "alice"}) as a_held,
        bob.stream("POST", "/generate", json={**held, "rid": HELD + "bob"}) as b_held,
    ):
        a_long_events, a_held_events = _events(a_long.iter_lines()), _events(a_held.iter_lines())
        b_held_events = _events(b_held.iter_lines())
        for events in (a_long_events, a_held_events, b_held_events):
            assert next(events)["meta_info"]["finish_reason"] is None  # all three are running
        assert bob.post("/abort_request", json={"rid": HELD + "alice"}).status_code == 200
        assert bob.post("/abort_request", json={"abort_all": True}).status_code == 200
        *_, last = b_held_events
        assert last["meta_info"]["finish_reason"]["type"] == "abort"  # bob's own: ended
        # the scheduler has applied both of bob's aborts (his own request's end came after
        # them); alice's paused request is still there, so the scheduler is not idle
        assert alice.get("/get_server_info").json()["leak_check"]["idle"] is False
        *_, last = a_long_events
        assert last["meta_info"]["finish_reason"]["type"] == "length"  # ran to its end
        assert last["meta_info"]["completion_tokens"] == 400
        assert alice.post("/abort_request", json={"abort_all": True}).status_code == 200
        *_, last = a_held_events
        assert last["meta_info"]["finish_reason"]["type"] == "abort"  # her own abort_all
    assert wait_idle_and_clean(alice)["problems"] == []
    # /flush_cache would empty every key's cache: refused to each key, with the flag named
    _cached(alice, SECRET, "flush-probe")
    for c in (bob, alice):
        r = c.post("/flush_cache")
        assert r.status_code == 403 and "--admin-api-key" in r.json()["message"], r.text
        assert r.json()["object"] == "error"
    assert _cached(alice, SECRET, "flush-probe") == len(SECRET)  # her cache is still there
    assert _cached(bob, [9, 10, 11]) == 0  # and the server keeps serving
    assert wait_idle_and_clean(bob)["problems"] == []


@pytest.fixture(scope="module")
def secret_server(tiny_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secret")
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path), *TRACKED]
    srv = start(cmd, tmp / "log", {"HYBRID_SERVE_SESSION_SECRET": "s3cret"})
    try:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c
    finally:
        assert srv.stop(signal.SIGTERM) == 0


def test_keyless_session_ids_carry_a_tag_and_time_out(secret_server):
    http = secret_server
    sid = http.post("/open_session", json={"session_id": "alice-chat"}).json()
    assert re.fullmatch(r"alice-chat\.[0-9a-f]{32}", sid)
    forged = "alice-chat." + "0" * 32
    for guess in ("alice-chat", forged, sid[:-1] + "x"):
        assert _turn(http, [5, 6], id=guess).status_code == 404
        assert http.post("/close_session", json={"session_id": guess}).status_code == 404
    assert _turn(http, [5, 6], id=sid).status_code == 200
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    # server-generated ids: 128 random bits and the tag, never the same twice
    a, b = (http.post("/open_session", json={"timeout": 1.0}).json() for _ in range(2))
    assert a != b and re.fullmatch(r"[0-9a-f]{32}\.[0-9a-f]{32}", a)
    assert _turn(http, [5, 6], id=a).status_code == 200
    time.sleep(2.5)  # past the 1 s timeout: reaped, its held state freed
    assert _turn(http, [5, 6], id=a).status_code == 404
    assert http.post("/close_session", json={"session_id": b}).status_code == 404
    info = http.get("/get_server_info").json()
    assert info["server_config"]["session_secret"] is None  # from the environment, never shown
    assert info["pools"]["num_sessions"] == 0
    assert wait_idle_and_clean(http)["problems"] == []


def _cached(c: httpx.Client, ids: list[int], salt: str | None = None, chat: bool = False) -> int:
    if chat:  # the OpenAI route: the same field, the same cache
        body = {"model": "default", "prompt": ids, "max_tokens": 4, "temperature": 0.0}
        r = c.post("/v1/completions", json={**body, "cache_salt": salt} if salt else body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    body = {"input_ids": ids, "sampling_params": GREEDY}
    r = c.post("/generate", json={**body, "cache_salt": salt} if salt else body)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def test_the_pin_probe_fails_under_two_salts(secret_server):
    http = secret_server
    # the probe itself, without salts: the right guess hits it all, a wrong one nothing
    _cached(http, SECRET)
    assert _cached(http, WRONG) == 0 and _cached(http, SECRET) == len(SECRET)
    http.post("/flush_cache").raise_for_status()
    _cached(http, SECRET, "alice-salt")
    assert _cached(http, SECRET, "mallory-salt") == 0  # the right guess tells nothing
    assert _cached(http, SECRET) == 0  # nor does leaving the salt out
    assert _cached(http, SECRET, "alice-salt", chat=True) == len(SECRET)  # the same salt hits
    assert http.post("/generate", json={"text": "x", "cache_salt": ""}).status_code == 400
    assert wait_idle_and_clean(http)["problems"] == []


def test_the_pin_probe_fails_under_per_key_isolation(two_keys):
    alice, bob = two_keys
    _cached(alice, SECRET)
    assert _cached(bob, SECRET) == 0
    assert _cached(bob, SECRET, "alice-key") == 0  # no salt reaches another key's entries
    assert _cached(alice, SECRET, chat=True) == len(SECRET)  # her own key still hits
    assert _cached(alice, SECRET, "other") == 0  # a salt of her own is a namespace of its own
    assert wait_idle_and_clean(alice)["problems"] == []
