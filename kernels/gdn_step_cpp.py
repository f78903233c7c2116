"""The Gated DeltaNet decode step after its projections as one C++ CPU op per layer, and its
speculative-verify form (`gdn_verify`: each request's few rows in order in one call).

Same signatures and contracts as `kernels.gdn_step`'s. One call replaces the
reference's ~40 torch ops: the conv update (silu vectorised across channels), the gates, the
l2 norms, the recurrent update in place on the pool (each head state read once, updated and
read out while in cache: no gather or scatter) and the gated RMSNorm. It covers fp32
activations, pools and parameters (the CPU model's, with fp32 or bf16 matrices); anything else
runs the reference.
"""

from __future__ import annotations

import torch

from kernels import cpp_build, gdn_step


def gdn_decode(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    args = (
        qkvz, ba, conv_pool, ssm_pool, layer, conv_weight, A_log, dt_bias, norm_weight, slots,
        num_k_heads, eps,
    )  # fmt: skip
    ops = cpp_build.load()
    floats = (qkvz, ba, conv_pool, ssm_pool, A_log, conv_weight, dt_bias, norm_weight)
    if ops is None or not _runs_cpp(floats, (conv_pool, ssm_pool)):
        return gdn_step.gdn_decode(*args)
    return ops.gdn_decode(
        qkvz.contiguous(), ba.contiguous(), conv_pool[layer], conv_weight.contiguous(),
        ssm_pool[layer], A_log, dt_bias, norm_weight, slots.long().contiguous(), num_k_heads,
        float(eps),
    )  # fmt: skip


def _runs_cpp(tensors: tuple[torch.Tensor, ...], pools: tuple[torch.Tensor, ...]) -> bool:
    return all(t.dtype == torch.float32 for t in tensors) and all(p.is_contiguous() for p in pools)


def verify_rows(lens: list[int], step_slots: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ form of a verify's rows: starts [N+1] (each request's first row), steps [N, w]
    (its step slots, -1 past them), int64 on the CPU."""
    width = max(max(lens, default=1) - 1, 1)
    steps = torch.full((len(lens), width), -1, dtype=torch.int64)
    for n, row in enumerate(step_slots):
        steps[n, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0), steps


def gdn_verify(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    slots: torch.Tensor,
    lens: list[int],
    step_slots: list[list[int]],
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    ops = cpp_build.load()
    floats = (qkvz, ba, conv_pool, ssm_pool, A_log, conv_weight, dt_bias, norm_weight)
    if ops is None or not _runs_cpp(floats, (conv_pool, ssm_pool)):
        return gdn_step.gdn_verify(
            qkvz, ba, conv_pool, ssm_pool, layer, conv_weight, A_log, dt_bias, norm_weight,
            slots, lens, step_slots, num_k_heads, eps, decode=gdn_decode,
        )  # fmt: skip
    starts, steps = verify_rows(lens, step_slots)
    return ops.gdn_verify(
        qkvz.contiguous(), ba.contiguous(), conv_pool[layer], conv_weight.contiguous(),
        ssm_pool[layer], A_log, dt_bias, norm_weight, slots.long().contiguous(), starts, steps,
        num_k_heads, float(eps),
    )  # fmt: skip
