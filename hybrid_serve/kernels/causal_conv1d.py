"""Depthwise causal conv1d with a per-sequence state pool: pure-torch reference ops.

    y_t[c] = act( sum_{j<Kc} w[c, j] * x_{t-Kc+1+j}[c] + bias[c] )

The state of a sequence is its last Kc-1 inputs, channel-first (`conv_states[slot]` is
[dim, Kc-1]). Signatures follow SGLang's Triton kernels: prefill takes channel-first packed
tokens with `query_start_loc`, decode takes one token per row; both read and update the states
in place through `cache_indices` / `conv_state_indices`. Rows whose index equals
`pad_slot_id` are skipped: their outputs are zero and no state is touched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d_fn(
    x: torch.Tensor,  # [dim, total_tokens]
    weight: torch.Tensor,  # [dim, Kc]
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,  # [slots, dim, Kc-1], updated in place
    query_start_loc: torch.Tensor,  # [N+1]
    cache_indices: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool: start from conv_states[idx], else zeros
    activation: str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Prefill over packed sequences; returns y [dim, total_tokens] in x's dtype."""
    dim, width = weight.shape
    out = torch.zeros_like(x)
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist()
    has_init = has_initial_state.tolist()
    w = weight.unsqueeze(1)  # [dim, 1, Kc] for a grouped conv
    for i, slot in enumerate(slots):
        if slot == pad_slot_id:
            continue
        lo, hi = starts[i], starts[i + 1]
        if has_init[i]:
            history = conv_states[slot].to(weight.dtype)
        else:
            history = x.new_zeros(dim, width - 1, dtype=weight.dtype)
        window = torch.cat([history, x[:, lo:hi].to(weight.dtype)], dim=-1)  # [dim, Kc-1+len]
        y = F.conv1d(window.unsqueeze(0), w, bias, groups=dim)[0]  # [dim, len]
        out[:, lo:hi] = _act(y, activation).to(x.dtype)
        conv_states[slot] = window[:, window.shape[-1] - (width - 1) :].to(conv_states.dtype)
    return out


def live_rows(idx: torch.Tensor, pad_slot_id: int = PAD_SLOT_ID) -> torch.Tensor:
    """[B] bool: rows that own their slot. A row whose slot is `pad_slot_id`, or repeats an
    earlier row's slot (padding rows on the reserved slot 0), is padding."""
    repeats = (idx.unsqueeze(1) == idx.unsqueeze(0)).tril(-1).any(1)
    return (idx != pad_slot_id) & ~repeats


def row_slots(
    indices: torch.Tensor | None, rows: int, device: torch.device, pad_slot_id: int = PAD_SLOT_ID
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's (slot of each row, `live_rows`, a slot safe to read for each row: its
    own, or 0 for padding), [B] each; `indices` None means row b uses slot b."""
    idx = torch.arange(rows, device=device) if indices is None else indices.long()
    live = live_rows(idx, pad_slot_id)
    return idx, live, torch.where(live, idx, torch.zeros_like(idx))


def causal_conv1d_update(
    x: torch.Tensor,  # [B, dim] one new token per row
    conv_state: torch.Tensor,  # [slots, dim, Kc-1], updated in place
    weight: torch.Tensor,  # [dim, Kc]
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,  # [B]; None means row b uses slot b
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """One decode step; returns y [B, dim] in x's dtype. Padding rows (`live_rows`) get zero
    output and touch no state."""
    idx, live, safe = row_slots(conv_state_indices, x.shape[0], x.device, pad_slot_id)
    history = conv_state.index_select(0, safe).to(weight.dtype)
    window = torch.cat([history, x.unsqueeze(-1).to(weight.dtype)], -1)
    y = (window * weight.unsqueeze(0)).sum(-1)  # [B, dim]
    if bias is not None:
        y = y + bias
    y = _act(y, activation)
    new_state = window[:, :, 1:].to(conv_state.dtype)
    if bool(live.all()):
        conv_state.index_copy_(0, idx, new_state)
    else:
        conv_state.index_copy_(0, idx[live], new_state[live])
        y = y * live.unsqueeze(-1)
    return y.to(x.dtype)
