"""How many KV tokens fit in the memory the user gives, and the start-up line that says so.

Two ways to give memory (both off by default, when `--max-total-tokens` decides):
  --mem-fraction-static F   CUDA: F of the device's memory holds the weights and the pools
                            (SGLang's meaning: the rest is left to activations and graphs)
  --pool-memory-gb G        any device: G GB (1e9 bytes) for the KV and Mamba pools

The Mamba pool is sized first (its slot count follows the strategy and
`--max-running-requests`, or `--max-mamba-cache-size`), the request table next, and the KV pool
takes the rest, rounded down to whole pages. Sizes per unit:

    KV token    = sum over attention layers of the row each describes (`model.kv_shapes`,
                  `mem_cache/kv_shape.py`) x dtype bytes: MHA/GQA 2 (K, V) x kv_heads x
                  head_dim, MLA one latent row of kv_lora_rank + qk_rope_head_dim
    Mamba slot  = sum over recurrent layers of (conv_dim x (K - 1) x dtype bytes
                  + the temporal state's elements x its dtype's bytes), as each layer
                  describes its state (`model.state_shapes`), + hidden_size x dtype bytes (the
                  slot's final-hidden row, exact repeats)

The start-up line gives the KV bytes per token with the layout they come from; for MLA also
what the expanded K and V of its heads would take (the latent row is about a tenth of it).

The temporal (SSM) state's dtype is `--mamba-ssm-dtype` (SGLang's flag), else the checkpoint's
`mamba_ssm_dtype` (`models.base_config.checkpoint_ssm_dtype`: float32 unless it says otherwise).

Capacity (`capacity`): how many requests the pools let run at once, next to
`--max-running-requests`. The Mamba pool is a hard cap: its slots over the slots an admitted
request holds until it finishes (`SchedulerConfig.mamba_slots_held`); when it is below
`--max-running-requests`, start-up logs one WARNING naming the cap, the bytes per slot and the
flags that change it. The KV pool's bound depends on the requests: admission waits until a
request's prompt and expected output fit, so its tokens over one whole context
(`--context-length`, in whole pages) is how many requests that each fill the context run at once;
shorter ones fit more. That count is logged (INFO) and shown beside the cap, not taken as one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybrid_serve.kernels.fp8 import weight_bytes
from hybrid_serve.mem_cache.kv_shape import common_kv_shape, kv_bytes_per_token
from hybrid_serve.mem_cache.state_shape import state_bytes_per_slot
from hybrid_serve.models.loader import DTYPES
from hybrid_serve.models.protocol import ServedConfig, ServedModel

GB = 1e9
MAMBA_POOL = "mamba_pool"


@dataclass(frozen=True)
class PoolBytes:
    kv_per_token: int
    mamba_per_slot: int
    weights: int
    ssm_dtype: torch.dtype = torch.float32
    kv_layout: str = ""  # the KV rows in words (`KVShape.describe`)


def ssm_state_dtype(cfg, model: ServedModel) -> torch.dtype:
    """The Mamba pool's temporal-state dtype: `cfg.mamba_ssm_dtype` (a RunnerConfig's), else
    the checkpoint's."""
    return DTYPES[cfg.mamba_ssm_dtype or model.config.mamba_ssm_dtype]


def pool_bytes(model: ServedModel, ssm_dtype: torch.dtype = torch.float32) -> PoolBytes:
    c: ServedConfig = getattr(model, "local_config", model.config)  # per tensor-parallel rank
    dtype = next(model.parameters()).dtype
    kv_shapes = model.kv_shapes  # one per KV-pool layer, the MTP head's included
    kv = kv_bytes_per_token(kv_shapes, dtype)
    shape = common_kv_shape(kv_shapes)
    layout = f"{len(kv_shapes)} layers, {shape.describe()}" if shape is not None else "no layers"
    states = state_bytes_per_slot(model.state_shapes, dtype, ssm_dtype)
    weights = sum(weight_bytes(p) for p in model.parameters())  # FP8 matrices: 1 B + scales
    hidden = c.hidden_size * dtype.itemsize
    return PoolBytes(kv, states + hidden, weights, ssm_dtype, layout)


def _budget(cfg, sizes: PoolBytes) -> float | None:
    """Bytes for the pools, or None when the user gave no memory figure."""
    if cfg.mem_fraction_static and cfg.pool_memory_gb:
        raise ValueError("give --mem-fraction-static or --pool-memory-gb, not both")
    if cfg.pool_memory_gb:
        return cfg.pool_memory_gb * GB
    if not cfg.mem_fraction_static:
        return None
    if not cfg.device.startswith("cuda"):
        raise ValueError("--mem-fraction-static sizes GPU memory; on CPU use --pool-memory-gb")
    total = torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory
    return cfg.mem_fraction_static * total - sizes.weights


def size_pools(cfg, sizes: PoolBytes):
    """`cfg` (a RunnerConfig with its Mamba pool size resolved) with `max_total_tokens` set from
    the memory budget, when one was given; a budget too small for one full context is a
    ValueError saying what fits."""
    budget = _budget(cfg, sizes)
    if budget is None:
        return cfg
    fixed = cfg.mamba_slots * sizes.mamba_per_slot
    fixed += cfg.max_running_requests * cfg.max_context_len * 4  # req_to_token (int32)
    pages = int((budget - fixed) // (sizes.kv_per_token * cfg.page_size))
    tokens = max(pages, 0) * cfg.page_size
    if tokens < cfg.max_context_len:
        raise ValueError(
            f"pool memory {budget / GB:.3f} GB leaves {tokens} KV tokens after "
            f"{cfg.mamba_slots} Mamba slots ({fixed / GB:.3f} GB with the request table); "
            f"need at least the context length {cfg.max_context_len}"
        )
    return replace(cfg, max_total_tokens=tokens)


def describe(cfg, sizes: PoolBytes) -> str:
    kv = cfg.max_total_tokens * sizes.kv_per_token
    mamba = cfg.mamba_slots * sizes.mamba_per_slot
    return (
        f"memory: weights {sizes.weights / GB:.3f} GB; KV pool {cfg.max_total_tokens} tokens x "
        f"{sizes.kv_per_token} B ({sizes.kv_layout}) = {kv / GB:.3f} GB; "
        f"Mamba pool {cfg.mamba_slots} slots x "
        f"{sizes.mamba_per_slot / 1e6:.2f} MB ({sizes.mamba_per_slot / 2**20:.1f} MiB, "
        f"{str(sizes.ssm_dtype).removeprefix('torch.')} SSM states) = {mamba / GB:.3f} GB"
    )


@dataclass(frozen=True)
class Capacity:
    """Requests that may run at once: as configured, as the Mamba pool allows, and the smaller;
    and how many requests that each fill the whole context the KV pool holds."""

    max_running_requests: int  # --max-running-requests
    mamba_pool_requests: int  # Mamba slots // slots held per request
    kv_pool_full_context_requests: int  # KV tokens // one whole context (in pages)
    effective_max_running_requests: int
    limited_by: str | None  # MAMBA_POOL, or None when nothing caps the configured value


def capacity(cfg, sched_cfg) -> Capacity:
    """The capacity of a RunnerConfig's pools (sizes resolved) under a SchedulerConfig's
    strategy."""
    mamba = cfg.mamba_slots // sched_cfg.mamba_slots_held()
    pages = -(-cfg.max_total_tokens // cfg.page_size)
    kv = pages // -(-cfg.max_context_len // cfg.page_size)
    effective = min(cfg.max_running_requests, mamba)
    limited_by = MAMBA_POOL if effective < cfg.max_running_requests else None
    return Capacity(cfg.max_running_requests, mamba, kv, effective, limited_by)


def capacity_warning(cfg, sched_cfg, sizes: PoolBytes) -> str | None:
    """The start-up WARNING when the Mamba pool holds fewer requests than
    --max-running-requests, naming the cap, the bytes per slot and the flags that change it;
    None when it does not cap."""
    cap = capacity(cfg, sched_cfg)
    if cap.limited_by is None:
        return None
    return (
        f"at most {cap.effective_max_running_requests} requests run at once, not "
        f"--max-running-requests {cap.max_running_requests}: the Mamba pool's "
        f"{cfg.mamba_slots} slots x {sizes.mamba_per_slot} B hold {cap.mamba_pool_requests} "
        f"requests ({sched_cfg.mamba_slots_held()} slots each, --mamba-scheduler-strategy "
        f"{sched_cfg.mamba_scheduler_strategy}; raise --max-mamba-cache-size); the others wait "
        f"in the queue (or lower --max-running-requests to {cap.effective_max_running_requests})"
    )


def kv_capacity_note(cfg, sched_cfg, sizes: PoolBytes) -> str | None:
    """The start-up INFO line when fewer than --max-running-requests requests that each fill
    the whole context fit in the KV pool (shorter requests fit more); None otherwise."""
    cap = capacity(cfg, sched_cfg)
    if cap.kv_pool_full_context_requests >= cap.max_running_requests:
        return None
    return (
        f"the KV pool's {cfg.max_total_tokens} tokens x {sizes.kv_per_token} B hold "
        f"{cap.kv_pool_full_context_requests} requests that each fill the whole context "
        f"{cfg.max_context_len} (shorter requests fit more; --max-total-tokens, --pool-memory-gb "
        "or --mem-fraction-static give it more)"
    )
