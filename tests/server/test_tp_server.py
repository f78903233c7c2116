"""`hybrid-serve --tp-size 2`: the server spawns its second rank, serves the tokens transformers
gives, and a rank that dies stops the whole server with a message naming it (exit 1, no hang)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from tests.hf_reference import hf_greedy
from tests.server.conftest import children_of, serve_command, start

FLAGS = ("--tp-size", "2", "--max-total-tokens", "2048", "--max-running-requests", "4")


def _follower(server_pid: int) -> int:
    """The spawned rank 1: the scheduler process's child that runs `follower_main`."""
    for scheduler in children_of(server_pid):
        for pid in children_of(scheduler):
            if b"follower_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError("no tensor-parallel rank process found")


def test_tp2_server_serves_and_a_dead_rank_stops_it(tiny_path, tmp_path):
    log = tmp_path / "server.log"
    srv = start(serve_command(tiny_path, *FLAGS), log)
    try:
        srv.wait_healthy()
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (3, 30)]
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            got = []
            for p in prompts:
                body = {
                    "input_ids": p,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                }
                r = http.post("/generate", json=body)
                assert r.status_code == 200, r.text
                got.append(r.json()["output_ids"])
        hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
        assert got == hf_greedy(hf, prompts, 8)

        os.kill(_follower(srv.proc.pid), signal.SIGKILL)  # the server is idle now
        deadline = time.monotonic() + 60
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert srv.proc.returncode == 1, log.read_text()[-3000:]
        assert "tensor-parallel rank 1 exited (code -9)" in log.read_text()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
