"""The Mamba2 decode step after its input projection as one C++ CPU op per layer, and its
speculative-verify form (`mamba2_verify`: each request's few rows in order in one call).

Same signatures and contracts as `kernels.mamba2_step`'s. One call replaces the reference's
~30 torch ops: the conv update with its bias (silu vectorised across channels), dt's softplus
and limit, the state update in place on the pool (each head's state read once, updated and read
against C while in registers: no gather or scatter), the D skip and the gate-first grouped
RMSNorm. Load-time contract (the C++ set is chosen only for it, `kernels.kernel_set.cpp_set`):
fp32 activations, contiguous fp32 pools and fp32 parameters; the C++ op rejects anything else.
"""

from __future__ import annotations

import torch

from kernels import cpp_build
from kernels.gdn_step_cpp import verify_rows


def mamba2_decode(
    zxbcdt: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor | None,
    slots: torch.Tensor,
    num_groups: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    lo, hi = dt_limit
    return cpp_build.load().mamba2_decode(
        zxbcdt.contiguous(), conv_pool[layer], conv_weight.contiguous(), conv_bias,
        ssm_pool[layer], A_log, dt_bias, D, norm_weight, slots.long().contiguous(), num_groups,
        float(eps), float(lo), float(hi),
    )  # fmt: skip


def mamba2_verify(
    zxbcdt: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor | None,
    slots: torch.Tensor,
    lens: list[int],
    step_slots: list[list[int]],
    num_groups: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    lo, hi = dt_limit
    starts, steps = verify_rows(lens, step_slots)
    return cpp_build.load().mamba2_verify(
        zxbcdt.contiguous(), conv_pool[layer], conv_weight.contiguous(), conv_bias,
        ssm_pool[layer], A_log, dt_bias, D, norm_weight, slots.long().contiguous(), starts,
        steps, num_groups, float(eps), float(lo), float(hi),
    )  # fmt: skip
