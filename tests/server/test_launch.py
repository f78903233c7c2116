"""Starting and stopping: the command `make serve` runs, /health before and after loading, a
curl-like request, SIGINT and SIGTERM shutdowns without orphans, and the API key."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.conftest import REPO, start


def make_serve_command() -> list[str]:
    """The command `make serve` runs (its last recipe line, from `make -n`), with this
    interpreter's environment as the venv."""
    # under `make test` the parent make's MAKEFLAGS/MAKELEVEL would add "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "serve", f"VENV={sys.prefix}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    cmd = shlex.split(out.stdout.strip().splitlines()[-1])
    assert cmd == [f"{sys.prefix}/bin/hybrid-serve"], cmd  # the server, on the default model
    return cmd


def test_make_serve_starts_the_default_model(tmp_path):
    cache = tmp_path / "cache"
    srv = start(make_serve_command(), tmp_path / "serve.log", {"HYBRID_SERVE_CACHE": str(cache)})
    seen: list[int] = []
    try:
        srv.wait_healthy(seen)
        assert 503 in seen, seen  # answered before the model was loaded
        assert (cache / "tiny" / "config.json").is_file()  # the preset, written on first use
        body = b'{"model": "tiny", "prompt": "Say hi", "max_tokens": 4}'
        url = f"{srv.url}/v1/completions"
        # as bare `curl -d` sends it (a form type): refused, so no HTML form can pass for it
        assert httpx.post(url, content=body).status_code == 415
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        status = srv.stop(signal.SIGINT)
    assert status == 0, srv.log.read_text()[-3000:]


def test_api_key_and_sigterm(tiny_path, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "hybrid_serve.server",
        "--model-path",
        str(tiny_path),
        "--api-key",
        "s3cret",
    ]
    srv = start(cmd, tmp_path / "key.log")
    try:
        srv.wait_healthy()  # /health is open
        body = {"model": "default", "prompt": "x", "max_tokens": 2}
        url = f"{srv.url}/v1/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["object"] == "error" and r.json()["code"] == 401
        assert httpx.get(f"{srv.url}/get_server_info").status_code == 401
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        ok = httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope").models.list()
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret")
        assert good.models.list().data[0].id == tiny_path.name
    finally:
        status = srv.stop(signal.SIGTERM)
    assert status == 0, srv.log.read_text()[-3000:]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "config.json not found" in out.stderr
