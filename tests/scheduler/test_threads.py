"""Torch thread count: --num-threads, OMP_NUM_THREADS and the affinity-based default."""

from __future__ import annotations

import os

import pytest
import torch

from hybrid_serve.scheduler.cpu_env import configure_threads, default_num_threads
from hybrid_serve.scheduler.model_runner import RunnerConfig
from tests.serve_args import parse_serve_args


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_follows_omp_num_threads_then_affinity(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_num_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert default_num_threads() == len(os.sched_getaffinity(0))


def test_configure_threads(monkeypatch, restore_threads) -> None:
    torch.set_num_threads(1)
    assert configure_threads(0, pick_default=False) == 1  # the Engine: left alone
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert configure_threads(0, pick_default=True) == 2  # the server's default
    assert configure_threads(1, pick_default=True) == 1  # --num-threads wins


def test_num_threads_flag() -> None:
    _, runner, _ = parse_serve_args(["--num-threads", "3"])
    assert runner.num_threads == 3
    with pytest.raises(ValueError, match="num-threads"):
        RunnerConfig(num_threads=-1)
