"""Mamba2's recurrence one token at a time, for decode: pure-torch reference op.

Per head h (state S in R^{P x N}, group g = h // (H/G)):

    dt = clamp(softplus(dt + dt_bias), *dt_limit)
    S  = exp(dt A) S + dt x B^T,        y = S C + D x

Signature after mamba_ssm's `selective_state_update` with per-head dt, A, D and dt_bias (its
"tied head dim" form) and the pool extension: `state` is the whole [slots, H, P, N] pool of one
layer, row b steps `state[state_batch_indices[b]]` in place. A row whose index is `pad_slot_id`,
or repeats an earlier row's (padding rows on the reserved slot 0), is padding: zero output, no
state written. Math in fp32; the state is stored back in its own dtype, and the output is read
from the fp32 state before that rounding.
"""

from __future__ import annotations

import torch

from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID, row_slots
from hybrid_serve.kernels.ssd import discretize_dt, heads_of_groups


def selective_state_update(
    state: torch.Tensor,  # [slots, H, P, N], updated in place
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H] before bias and softplus
    A: torch.Tensor,  # [H] (negative)
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_batch_indices: torch.Tensor | None = None,  # [B]; None: row b uses slot b
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Returns y [B, H, P] in x's dtype."""
    rows, H, _ = x.shape
    idx, live, safe = row_slots(state_batch_indices, rows, x.device, pad_slot_id)
    xf = x.float()
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [B, H]
    decay = (dt * A.float()).exp()[:, :, None, None]  # [B, H, 1, 1]
    Bh, Ch = heads_of_groups(B.float(), H), heads_of_groups(C.float(), H)  # [B, H, N]
    s = state.index_select(0, safe).float()  # [B, H, P, N]
    s = s * decay + (xf * dt.unsqueeze(-1)).unsqueeze(-1) * Bh.unsqueeze(-2)
    y = torch.einsum("bhpn,bhn->bhp", s, Ch)
    if D is not None:
        y = y + D.float()[:, None] * xf
    if bool(live.all()):
        state.index_copy_(0, idx, s.to(state.dtype))
    else:
        state.index_copy_(0, idx[live], s[live].to(state.dtype))
        y = y * live.view(rows, 1, 1)
    return y.to(x.dtype)
