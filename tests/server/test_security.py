"""Probes from issue 14 that must fail to get in: a browser form or page on another origin, a
foreign Host header (DNS rebinding), non-JSON bodies, inference keys on admin routes, and keys
leaking through the command line, the logs or /get_server_info."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from hybrid_serve.server.errors import APIError
from hybrid_serve.server.security import Keys
from tests.server.conftest import HELD, HOLD_ENV, serve_command, start, wait_idle_and_clean

BODY = {"model": "default", "prompt": "x", "max_tokens": 2}


def test_keyless_server_refuses_browsers_and_foreign_hosts(http):
    # A cross-site form POST (what a page on evil.example can send without CORS): refused twice
    # over, for its origin and for its content type; abort_all never reaches the scheduler.
    form = {"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"}
    for path in ("/abort_request", "/v1/completions"):
        r = http.post(path, content=b'{"abort_all": true}', headers=form)
        assert r.status_code == 403, r.text
        assert r.json()["object"] == "error"
    r = http.post("/v1/completions", json=BODY, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = http.options("/v1/completions", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # DNS rebinding: the browser sends the attacker's name as Host
    r = http.post("/v1/completions", json=BODY, headers={"Host": "evil.example:30000"})
    assert r.status_code == 400 and "not allowed" in r.json()["message"]
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = http.post("/v1/completions", content=b"{}", headers={"Content-Type": ctype})
        assert r.status_code == 415, ctype
    # the same request, properly sent, still works; loopback names are all accepted
    for host in ("localhost", "127.0.0.1", "[::1]"):
        r = http.post("/v1/completions", json=BODY, headers={"Host": f"{host}:1"})
        assert r.status_code == 200, (host, r.text)


@pytest.fixture(scope="module")
def keyed_server(tiny_path, tmp_path_factory):
    """One keyed server for the module's two tests, in either order. Its teardown stops it and
    reads its whole log: no key may appear there (asserted after the last test that used it)."""
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = tmp / "keys"
    key_file.write_text("# two users\nuser-two-key\n\nuser-three-key\n")
    cmd = serve_command(
        tiny_path, "--api-key-file", str(key_file), "--allowed-origins", "http://ok.example"
    )
    env = {"HYBRID_SERVE_API_KEY": "env-key-one", "HYBRID_SERVE_ADMIN_API_KEY": "admin-key"}
    srv = start(cmd, tmp / "keyed.log", {**env, **HOLD_ENV})
    try:
        srv.wait_healthy()
        yield srv
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    log = srv.log.read_text()
    assert "env-key-one" not in log and "admin-key" not in log and "user-two-key" not in log


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_from_env_and_file_and_the_admin_key(keyed_server):
    url = keyed_server.url
    for key in ("env-key-one", "user-two-key", "user-three-key", "admin-key"):
        r = httpx.post(f"{url}/v1/completions", json=BODY, headers=_auth(key))
        assert r.status_code == 200, (key, r.text)
    assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=BODY, headers=_auth("nope")).status_code == 401
    # admin routes: an inference key is not enough once an admin key is set (even for its own
    # requests); the admin key's abort_all ends every key's requests
    abort_all = {"abort_all": True}
    body = {"input_ids": [3, 4], "rid": HELD + "user", "stream": True}  # paused at 2 outputs
    with httpx.stream(
        "POST", f"{url}/generate", json=body, headers=_auth("user-two-key"), timeout=60
    ) as held:
        lines = (line for line in held.iter_lines() if line.startswith("data:"))
        assert next(lines)
        for key, path in (("user-two-key", "/abort_request"), ("env-key-one", "/flush_cache")):
            r = httpx.post(f"{url}{path}", json=abort_all, headers=_auth(key))
            assert r.status_code == 403 and "--admin-api-key" in r.json()["message"], r.text
        r = httpx.post(f"{url}/abort_request", json=abort_all, headers=_auth("admin-key"))
        assert r.status_code == 200
        *_, last = (json.loads(line[5:]) for line in lines if line != "data: [DONE]")
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert httpx.post(f"{url}/flush_cache", headers=_auth("admin-key")).status_code == 200
    with httpx.Client(base_url=url, headers=_auth("admin-key")) as admin:
        assert wait_idle_and_clean(admin)["problems"] == []
    # a listed origin gets CORS answers (preflight included); others are refused
    pre = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{url}/v1/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    r = httpx.post(
        f"{url}/v1/completions",
        json=BODY,
        headers={**_auth("user-two-key"), "Origin": "http://ok.example"},
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    r = httpx.post(
        f"{url}/v1/completions", json=BODY, headers={**_auth("user-two-key"), "Origin": "http://x"}
    )
    assert r.status_code == 403


def test_keys_are_not_visible(keyed_server):
    info = httpx.get(f"{keyed_server.url}/get_server_info", headers=_auth("admin-key")).json()
    assert info["server_config"]["admin_api_key"] is None  # came from the environment
    text = str(info)
    procs = [keyed_server.proc.pid]
    procs += [
        int(p) for p in Path(f"/proc/{procs[0]}/task/{procs[0]}/children").read_text().split()
    ]
    for pid in procs:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        for key in ("env-key-one", "user-two-key", "admin-key"):
            assert key not in cmdline and key not in text


def test_who_may_act_server_wide():
    """`Keys.server_wide`, the rule behind /flush_cache and abort_all: keyless and one-key
    servers as before, the admin key always, an inference key among several never."""
    assert Keys().server_wide(False)
    assert Keys(("only",)).server_wide(False)
    assert not Keys(("alice", "bob")).server_wide(False)
    assert Keys(("alice", "bob"), "root").server_wide(True)
    assert Keys((), "root").server_wide(True)
    for keys in (Keys(("alice", "bob"), "root"), Keys(("only",), "root")):
        with pytest.raises(APIError, match="--admin-api-key") as e:
            keys.server_wide(False)
        assert e.value.status == 403
