"""Causal conv1d as C++ CPU kernels on the conv-state pool: decode update and prefill.

Same signatures and contracts as `kernels.causal_conv1d.causal_conv1d_update` and
`causal_conv1d_fn`. The C++ kernels cover fp32 pools with explicit slot indices, no bias and
silu or no activation. The update shifts each row's window in place; padding rows (index
`pad_slot_id` = -1, or repeating an earlier row's slot) get zero output and touch no state. The
prefill runs every packed sequence in one call (the reference loops over them in Python),
vectorised across channels of the token-major input, and returns y [dim, tokens] as a transposed
view of a [tokens, dim] tensor. Everything else runs the torch reference.
"""

from __future__ import annotations

import torch

from kernels import causal_conv1d, cpp_build
from kernels.causal_conv1d import PAD_SLOT_ID


def _ops(bias, activation, pad_slot_id: int, states: torch.Tensor):
    """The C++ ops where they cover these arguments, else None."""
    covered = (
        bias is None
        and activation in (None, "silu", "swish")
        and pad_slot_id == PAD_SLOT_ID
        and states.dtype == torch.float32
        and states.is_contiguous()
    )
    return cpp_build.load() if covered else None


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    ops = _ops(bias, activation, pad_slot_id, conv_state)
    if ops is None or conv_state_indices is None:
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


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    ops = _ops(bias, activation, pad_slot_id, conv_states)
    if ops is None:
        return causal_conv1d.causal_conv1d_fn(
            x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
            activation, pad_slot_id,
        )  # fmt: skip
    rows = x.t().float()  # [tokens, dim]: the model's x is a transposed column slice
    if rows.stride(-1) != 1:  # the op reads rows at any stride, channels contiguous
        rows = rows.contiguous()
    y = ops.conv1d_varlen_pool(
        rows,
        conv_states,
        weight.float().contiguous(),
        query_start_loc.long().contiguous(),
        cache_indices.long().contiguous(),
        has_initial_state.long().contiguous(),
        activation is not None,
    )
    return y.t().to(x.dtype)
