"""The Mamba2 decode step after its input projection, per layer: pure-torch reference ops.

    z, xBC, dt = split(zxbcdt, [I, I + 2GN, H])
    x, B, C = split(silu(causal conv1d update of xBC on the layer's conv window + conv bias))
    y = selective state update of the layer's state (dt = softplus(dt + dt_bias), A = -exp(A_log),
        D skip)
    y = rms_norm_gate_first(y, z, norm_weight, eps, I / G)        -> [T, I]  (ready for out_proj)

One token per row; the states live in the Mamba pool (`conv_pool`, `ssm_pool`: the pool's whole
[layers, slots, ...] tensors, `layer` picks the layer) and are updated in place at `slots`. A
negative slot, or one repeating an earlier row's (only the reserved padding slot 0 repeats), is
padding: zero output, no state written. This reference composes the unfused ops it is given (by
default the references of `causal_conv1d_update`, `selective_state_update` and
`rms_norm_gate_first`). `norm_weight=None` skips the norm: y * silu(z) (Falcon-H1 without its
Mamba norm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_serve.kernels.causal_conv1d import causal_conv1d_update
from hybrid_serve.kernels.rmsnorm import rms_norm_gate_first
from hybrid_serve.kernels.selective_state_update import selective_state_update


def mamba2_decode(
    zxbcdt: torch.Tensor,  # [T, I + conv_dim + H]
    conv_pool: torch.Tensor,  # [layers, slots, conv_dim, K-1]
    ssm_pool: torch.Tensor,  # [layers, slots, H, P, N]
    layer: int,
    conv_weight: torch.Tensor,  # [conv_dim, K]
    conv_bias: torch.Tensor | None,  # [conv_dim]
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H]
    D: torch.Tensor,  # [H]
    norm_weight: torch.Tensor | None,  # [I]
    slots: torch.Tensor,  # [T]
    num_groups: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    *,
    conv_update: Callable = causal_conv1d_update,
    state_update: Callable = selective_state_update,
    norm_gate_first: Callable = rms_norm_gate_first,
) -> torch.Tensor:
    """Returns y [T, I] in zxbcdt's dtype."""
    T = zxbcdt.shape[0]
    H, P, N = ssm_pool.shape[2:]
    inner, conv_dim = H * P, conv_pool.shape[2]
    z, xbc, dt = zxbcdt.split([inner, conv_dim, H], dim=-1)
    xbc = conv_update(xbc, conv_pool[layer], conv_weight, conv_bias, "silu", slots)
    x, B, C = xbc.split([inner, num_groups * N, num_groups * N], dim=-1)
    y = state_update(
        ssm_pool[layer], x.reshape(T, H, P), dt, -A_log.float().exp(),
        B.reshape(T, num_groups, N), C.reshape(T, num_groups, N), D, dt_bias, True, dt_limit,
        slots,
    )  # fmt: skip
    y = y.reshape(T, inner)
    if norm_weight is None:
        return (y.float() * F.silu(z.float())).to(zxbcdt.dtype)
    return norm_gate_first(y, z, norm_weight, eps, inner // num_groups).to(zxbcdt.dtype)


def mamba2_verify(
    zxbcdt: torch.Tensor,  # [T, I + conv_dim + H], request n's rows packed after n-1's
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor | None,
    slots: torch.Tensor,  # [N]: request n's state, updated in place through all its rows
    lens: list[int],  # [N] rows per request (>= 1)
    step_slots: list[list[int]],  # [N][lens[n] - 1]: the state after each row but the last
    num_groups: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    *,
    decode: Callable = mamba2_decode,
) -> torch.Tensor:
    """Speculative verify: each request's rows as consecutive decode steps on its slot, the
    conv window and state after its row j (but its last) also copied to `step_slots[n][j]`, so
    any prefix of the rows leaves exactly the state decoding those tokens one at a time leaves.
    Returns y [T, I] like `mamba2_decode`; runs `decode` once per row index."""
    inner = ssm_pool.shape[2] * ssm_pool.shape[3]
    out = zxbcdt.new_empty(zxbcdt.shape[0], inner)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)

    def col(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=zxbcdt.device)

    for j in range(max(lens, default=0)):
        live = [n for n, length in enumerate(lens) if length > j]
        rows = col([starts[n] + j for n in live])
        out[rows] = decode(
            zxbcdt[rows], conv_pool, ssm_pool, layer, conv_weight, conv_bias, A_log, dt_bias, D,
            norm_weight, slots[col(live)], num_groups, eps, dt_limit,
        )  # fmt: skip
        kept = [n for n in live if j < lens[n] - 1]
        if kept:
            src, dst = slots[col(kept)], col([step_slots[n][j] for n in kept])
            for pool in (conv_pool[layer], ssm_pool[layer]):
                pool.index_copy_(0, dst, pool.index_select(0, src))
    return out
