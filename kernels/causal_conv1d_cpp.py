"""Causal conv1d decode update as a C++ CPU kernel on the conv-state pool.

Same signature and contract as `kernels.causal_conv1d.causal_conv1d_update`. The C++ kernel
covers fp32 pools with explicit slot indices, no bias and silu or no activation; it shifts each
row's window in place. Padding rows (index `pad_slot_id` = -1, or repeating an earlier row's
slot) get zero output and touch no state. Everything else runs the torch reference.
"""

from __future__ import annotations

import torch

from kernels import causal_conv1d, cpp_build
from kernels.causal_conv1d import PAD_SLOT_ID


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    ops = cpp_build.load()
    if (
        ops is None
        or bias is not None
        or activation not in (None, "silu", "swish")
        or conv_state_indices is None
        or pad_slot_id != PAD_SLOT_ID
        or conv_state.dtype != torch.float32
        or not conv_state.is_contiguous()
    ):
        return causal_conv1d.causal_conv1d_update(
            x, conv_state, weight, bias, activation, conv_state_indices, pad_slot_id
        )
    y = ops.conv1d_update_pool(
        x.float().contiguous(),
        conv_state,
        weight.float().contiguous(),
        conv_state_indices.long().contiguous(),
        activation is not None,
    )
    return y.to(x.dtype)
