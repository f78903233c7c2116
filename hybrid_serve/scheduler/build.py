"""`build_scheduler`: a checkpoint directory and the two configs made into a ready `Scheduler`
(the model, its pools sized, the grammar backend). The server's scheduler process, the `Engine`
and every tensor-parallel follower rank build theirs here; benchmarks that drive a bare
`ModelRunner` load its model with `load_runner_model`."""

from __future__ import annotations

import logging
from dataclasses import replace

from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.protocol import ServedModel
from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
from hybrid_serve.scheduler.debug import DebugSwitches, install
from hybrid_serve.scheduler.grammar import GrammarBackend
from hybrid_serve.scheduler.lockstep import check_same_config
from hybrid_serve.scheduler.model_runner import ModelRunner
from hybrid_serve.scheduler.pool_sizing import (
    capacity_warning,
    describe,
    kv_capacity_note,
    pool_bytes,
    size_pools,
    ssm_state_dtype,
)
from hybrid_serve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def load_runner_model(
    model_path: str, runner_cfg: RunnerConfig, tp: ParallelContext | None = None
) -> ServedModel:
    """The checkpoint's model as `runner_cfg` asks for it: dtype, device, load format, weight
    quantization, and the MTP head (its own quantization) when it speculates."""
    return load_model(
        model_path, runner_cfg.dtype, runner_cfg.device, tp, runner_cfg.load_format,
        quantization=runner_cfg.quantization, mtp=runner_cfg.spec_steps > 0,
        draft_quantization=runner_cfg.speculative_draft_model_quantization,
        mamba_ssm_dtype=runner_cfg.mamba_ssm_dtype,
    )  # fmt: skip


def build_scheduler(
    model_path: str,
    runner_cfg: RunnerConfig,
    sched_cfg: SchedulerConfig,
    tp: ParallelContext | None = None,
) -> Scheduler:
    """Load the model and pools and make the scheduler; a Mamba pool size of 0 takes the
    strategy's default (`SchedulerConfig.mamba_slots_for`), and a memory budget sizes the KV
    pool (`scheduler.pool_sizing`). The sizes are logged, and a WARNING when the Mamba pool
    caps `--max-running-requests` (`pool_sizing.capacity_warning`). With a tensor-parallel
    context: this rank's shard and pools (every rank's loop runs on rank 0's inputs:
    `scheduler.lockstep`). The test switches set in the environment are installed here
    (`scheduler/debug.py`)."""
    if runner_cfg.mamba_cache_size == 0:
        slots = sched_cfg.mamba_slots_for(runner_cfg.max_running_requests)
        slots += runner_cfg.spec_steps * runner_cfg.max_running_requests  # verify's step slots
        runner_cfg = replace(runner_cfg, mamba_cache_size=slots)
    model = load_runner_model(model_path, runner_cfg, tp)
    sizes = pool_bytes(model, ssm_state_dtype(runner_cfg, model))
    runner_cfg = size_pools(runner_cfg, sizes)
    logger.info(describe(runner_cfg, sizes))
    if (warning := capacity_warning(runner_cfg, sched_cfg, sizes)) is not None:
        logger.warning(warning)
    if (note := kv_capacity_note(runner_cfg, sched_cfg, sizes)) is not None:
        logger.info(note)
    if tp is not None and tp.enabled:
        check_same_config(tp, runner_cfg, sched_cfg)
    grammar = GrammarBackend(model_path, model.config.vocab_size)
    scheduler = Scheduler(ModelRunner(model, runner_cfg), sched_cfg, grammar)
    install(scheduler, DebugSwitches.from_env())
    return scheduler
