"""Pools sized from a memory budget: the per-unit byte counts equal what the pools allocate, the
KV pool takes what the Mamba pool and request table leave, and impossible budgets are refused."""

from __future__ import annotations

import logging

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.model_runner import RunnerConfig
from hybrid_serve.scheduler.pool_sizing import (
    GB,
    MAMBA_POOL,
    PoolBytes,
    capacity,
    pool_bytes,
    size_pools,
)

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("t"), preset_config("tiny"), seed=2))


def test_unit_sizes_equal_the_pools(path):
    runner = Engine(path, max_running_requests=4, max_total_tokens=1000).runner
    sizes = pool_bytes(runner.model)
    kv, mamba = runner.kv_pool, runner.mamba_pool
    kv_rows = kv._k.shape[1]  # pages + the reserved page 0, times page size
    assert sizes.kv_per_token == (kv._k.nbytes + kv._v.nbytes) // kv_rows
    states = mamba.conv_state.nbytes + mamba.ssm_state.nbytes + mamba.hidden.nbytes
    per_slot = states // mamba.conv_state.shape[1]
    assert sizes.mamba_per_slot == per_slot
    assert sizes.weights == sum(p.numel() * p.element_size() for p in runner.model.parameters())


def test_budget_sizes_the_kv_pool(path, caplog):
    budget_gb = 0.02
    with caplog.at_level(logging.INFO, logger="hybrid_serve.scheduler.build"):
        engine = Engine(path, max_running_requests=4, pool_memory_gb=budget_gb, page_size=1)
    runner = engine.runner
    sizes = pool_bytes(runner.model)
    used = (
        runner.config.max_total_tokens * sizes.kv_per_token
        + runner.config.mamba_slots * sizes.mamba_per_slot
        + 4 * runner.config.max_context_len * 4
    )
    assert used <= budget_gb * GB < used + sizes.kv_per_token  # all of it, to one token
    assert runner.config.max_total_tokens > 10_000  # not the default 65536, not tiny
    assert any("KV pool" in r.getMessage() for r in caplog.records)
    out = engine.generate([[5, 6, 7]], GREEDY)
    assert len(out[0]["output_ids"]) == 4 and engine.leak_report() == []


def test_impossible_budgets_are_refused():
    sizes = PoolBytes(kv_per_token=1000, mamba_per_slot=10**6, weights=10**8)
    cfg = RunnerConfig(max_running_requests=4, mamba_cache_size=12, pool_memory_gb=0.01)
    with pytest.raises(ValueError, match="need at least the context length 4096"):
        size_pools(cfg, sizes)
    assert size_pools(RunnerConfig(mamba_cache_size=12), sizes) == RunnerConfig(mamba_cache_size=12)
    with pytest.raises(ValueError, match="on CPU use --pool-memory-gb"):
        size_pools(RunnerConfig(mem_fraction_static=0.8), sizes)
    with pytest.raises(ValueError, match="not both"):
        size_pools(RunnerConfig(mem_fraction_static=0.8, pool_memory_gb=1), sizes)
    with pytest.raises(ValueError, match="mem-fraction-static"):
        RunnerConfig(mem_fraction_static=1.5)


@pytest.mark.gpu
def test_mem_fraction_static_on_cuda(path):
    engine = Engine(path, device="cuda", max_running_requests=4, mem_fraction_static=0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    sizes = pool_bytes(engine.runner.model)
    kv = engine.runner.config.max_total_tokens * sizes.kv_per_token
    assert kv <= 0.05 * total - sizes.weights
    assert engine.generate([[5, 6, 7]], GREEDY)[0]["output_ids"]


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "hybrid_serve.scheduler.build" and r.levelno == logging.WARNING
    ]


def test_a_small_mamba_pool_is_one_warning(path, caplog):
    with caplog.at_level(logging.INFO, logger="hybrid_serve.scheduler.build"):
        engine = Engine(
            path, max_running_requests=4, mamba_cache_size=5, max_total_tokens=4 * 4096,
            mamba_scheduler_strategy="extra_buffer",
        )  # fmt: skip
    per_slot = pool_bytes(engine.runner.model).mamba_per_slot
    assert _warnings(caplog) == [
        "at most 1 requests run at once, not --max-running-requests 4: the Mamba pool's 5 "
        f"slots x {per_slot} B hold 1 requests (3 slots each, --mamba-scheduler-strategy "
        "extra_buffer; raise --max-mamba-cache-size); the others wait in the queue (or lower "
        "--max-running-requests to 1)"
    ]
    cap = capacity(engine.runner.config, engine.scheduler.config)
    assert (cap.effective_max_running_requests, cap.limited_by) == (1, MAMBA_POOL)


def test_a_small_kv_pool_is_an_info_line_not_a_cap(path, caplog):
    """Requests that each fill the whole context: 3 fit in this KV pool; shorter ones fit more,
    so it is said at INFO and the effective concurrency stays the configured one."""
    with caplog.at_level(logging.INFO, logger="hybrid_serve.scheduler.build"):
        engine = Engine(path, max_running_requests=4, max_total_tokens=3 * 4096 + 4095)
    per_token = pool_bytes(engine.runner.model).kv_per_token
    assert _warnings(caplog) == []
    assert (
        f"the KV pool's 16383 tokens x {per_token} B hold 3 requests that each fill the whole "
        "context 4096 (shorter requests fit more; --max-total-tokens, --pool-memory-gb or "
        "--mem-fraction-static give it more)"
    ) in [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    cap = capacity(engine.runner.config, engine.scheduler.config)
    assert (cap.mamba_pool_requests, cap.kv_pool_full_context_requests) == (12, 3)
    assert (cap.effective_max_running_requests, cap.limited_by) == (4, None)


def test_no_cap_no_warning(path, caplog):
    with caplog.at_level(logging.INFO, logger="hybrid_serve.scheduler.build"):
        engine = Engine(
            path, max_running_requests=4, max_total_tokens=4 * 4096,
            mamba_scheduler_strategy="extra_buffer_lazy", mamba_cache_size=8,
        )  # fmt: skip
    assert _warnings(caplog) == []
    cap = capacity(engine.runner.config, engine.scheduler.config)
    assert (cap.effective_max_running_requests, cap.limited_by) == (4, None)
