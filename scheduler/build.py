"""`build_scheduler`: a checkpoint directory and the two configs made into a ready `Scheduler`
(the model, its pools sized, the grammar backend). The server's scheduler process, the `Engine`
and every tensor-parallel follower rank build theirs here."""

from __future__ import annotations

import logging
from dataclasses import replace

from models.loader import load_model
from models.parallel import ParallelContext
from scheduler.config import RunnerConfig, SchedulerConfig
from scheduler.grammar import GrammarBackend
from scheduler.lockstep import check_same_config
from scheduler.model_runner import ModelRunner
from scheduler.pool_sizing import describe, pool_bytes, size_pools, ssm_state_dtype
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def build_scheduler(
    model_path: str,
    runner_cfg: RunnerConfig,
    sched_cfg: SchedulerConfig,
    tp: ParallelContext | None = None,
) -> Scheduler:
    """Load the model and pools and make the scheduler; a Mamba pool size of 0 takes the
    strategy's default (`SchedulerConfig.mamba_slots_for`), and a memory budget sizes the KV
    pool (`scheduler.pool_sizing`). The sizes are logged. With a tensor-parallel context: this
    rank's shard and pools (every rank's loop runs on rank 0's inputs: `scheduler.lockstep`)."""
    if runner_cfg.mamba_cache_size == 0:
        slots = sched_cfg.mamba_slots_for(runner_cfg.max_running_requests)
        slots += runner_cfg.spec_steps * runner_cfg.max_running_requests  # verify's step slots
        runner_cfg = replace(runner_cfg, mamba_cache_size=slots)
    model = load_model(
        model_path, runner_cfg.dtype, runner_cfg.device, tp, runner_cfg.load_format,
        quantization=runner_cfg.quantization, mtp=runner_cfg.spec_steps > 0,
        draft_quantization=runner_cfg.speculative_draft_model_quantization,
    )  # fmt: skip
    sizes = pool_bytes(model, ssm_state_dtype(runner_cfg, model))
    runner_cfg = size_pools(runner_cfg, sizes)
    logger.info(describe(runner_cfg, sizes))
    if tp is not None and tp.enabled:
        check_same_config(tp, runner_cfg, sched_cfg)
    grammar = GrammarBackend(model_path, model.config.vocab_size)
    return Scheduler(ModelRunner(model, runner_cfg), sched_cfg, grammar)
