"""The Gated DeltaNet decode step after its projections, per layer: pure-torch reference op.

    mixed_qkv, z = qkvz;  b, a = ba
    q, k, v = split(silu(causal conv1d update of mixed_qkv on the layer's conv window))
    g = -exp(A_log) * softplus(a + dt_bias);  beta = beta_scale * sigmoid(b)
                      (beta_scale 2 for OLMo-Hybrid's negative eigenvalues, else 1; a and
                      dt_bias one value per key channel for Kimi Delta Attention, so g too;
                      with a lower bound lb, KDA's "safe gate":
                      g = lb * sigmoid(exp(A_log) * (a + dt_bias)))
    o = gated delta rule recurrent update of the layer's state (q, k l2-normalised in it)
    y = norm_gated(o, z, norm_weight, eps)  (`rms_norm_gated`, silu; KDA: the sigmoid-gated
                                              `rms_norm_gated_sigmoid`)  -> [T, value_dim]

One token per row; the states live in the Mamba pool (`conv_pool`, `ssm_pool`: the pool's whole
[layers, slots, ...] tensors, `layer` picks the layer) and are updated in place at `slots`. A
negative slot, or one repeating an earlier row's (only the reserved padding slot 0 repeats), is
padding: zero output, no state read or written. This reference composes the unfused decode
ops it is given (by default the references of `causal_conv1d_update`,
`fused_recurrent_gated_delta_rule` and `rms_norm_gated`); `kernels.cpp_fused.gdn_decode` does it all
in one C++ call for the per-head gate and the silu-gated norm, `kernels.cpp_fused.kda_decode` for
KDA's per-channel gates and the sigmoid-gated norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_serve.kernels.causal_conv1d import causal_conv1d_update
from hybrid_serve.kernels.gated_delta_rule import fused_recurrent_gated_delta_rule
from hybrid_serve.kernels.rmsnorm import rms_norm_gated


def gates(
    b: torch.Tensor,
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float = 1.0,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, HV] -> (g, beta) [T, HV]: g = -exp(A_log) softplus(a + dt_bias) in fp32,
    beta = sigmoid(b) (times `beta_scale` when not 1). With a [T, HV * K] and dt_bias [HV * K]
    (Kimi Delta Attention's per-channel forget gate) g is [T, HV, K], head h's channels scaled
    by its exp(A_log[h]). A_log holds HV values in any shape (Kimi's is [1, 1, HV, 1]). With
    `lower_bound` (Ling's "safe gate", transformers' `kda_lower_bound`) g = lower_bound *
    sigmoid(exp(A_log) (a + dt_bias)) instead, so g stays in (lower_bound, 0). The one
    definition for prefill (the models) and this decode reference."""
    beta = b.sigmoid()
    if beta_scale != 1.0:
        beta = beta * beta_scale
    heads = b.shape[-1]
    rate = A_log.float().reshape(heads).exp()
    x = a.float() + dt_bias
    if x.shape[-1] != heads:  # per key channel
        x, rate = x.unflatten(-1, (heads, -1)), rate.unsqueeze(-1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x), beta
    return -rate * F.softplus(x), beta


def gdn_decode(
    qkvz: torch.Tensor,  # [T, 2 key_dim + 2 value_dim]: [q | k | v | z]
    ba: torch.Tensor,  # [T, 2 HV]: [b | a]; or [T, HV + HV dk]: a per key channel (KDA)
    conv_pool: torch.Tensor,  # [layers, slots, conv_dim, Kc-1]
    ssm_pool: torch.Tensor,  # [layers, slots, HV, dk, dv]
    layer: int,
    conv_weight: torch.Tensor,  # [conv_dim, Kc]
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    norm_weight: torch.Tensor,  # [dv]
    slots: torch.Tensor,  # [T]
    num_k_heads: int,
    eps: float,
    *,
    conv_update: Callable = causal_conv1d_update,
    recurrent: Callable = fused_recurrent_gated_delta_rule,
    norm_gated: Callable = rms_norm_gated,
    beta_scale: float = 1.0,
    gate_lower_bound: float | None = None,
) -> torch.Tensor:
    """Returns y [T, value_dim] in qkvz's dtype (ready for out_proj). `gate_lower_bound`:
    `gates`' `lower_bound`."""
    T = qkvz.shape[0]
    HV, dk, dv = ssm_pool.shape[2:]
    key_dim, value_dim = num_k_heads * dk, HV * dv
    mixed_qkv, z = qkvz.split([2 * key_dim + value_dim, value_dim], dim=-1)
    b, a = ba[:, :HV], ba[:, HV:]  # a [T, HV], or [T, HV * dk]: a per-channel gate
    mixed_qkv = conv_update(mixed_qkv, conv_pool[layer], conv_weight, None, "silu", slots)
    q, k, v = mixed_qkv.split([key_dim, key_dim, value_dim], dim=-1)
    q = q.reshape(T, 1, num_k_heads, dk)
    k = k.reshape(T, 1, num_k_heads, dk)
    v = v.reshape(T, 1, HV, dv)
    g, beta = (
        t.unsqueeze(1) for t in gates(b, a, A_log, dt_bias, beta_scale, gate_lower_bound)
    )  # [T, 1, HV]
    # g [T, 1, HV] per head, or [T, 1, HV, dk] per key channel
    core, _ = recurrent(
        q, k, v, g, beta, initial_state=ssm_pool[layer], initial_state_indices=slots,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    core = norm_gated(core.reshape(T * HV, dv), z.reshape(T * HV, dv), norm_weight, eps)
    return core.reshape(T, value_dim)


def gdn_verify(
    qkvz: torch.Tensor,  # [T, 2 key_dim + 2 value_dim], request n's rows packed after n-1's
    ba: torch.Tensor,  # [T, 2 HV]
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    slots: torch.Tensor,  # [N]: request n's state, updated in place through all its rows
    lens: list[int],  # [N] rows per request (>= 1)
    step_slots: list[list[int]],  # [N][lens[n] - 1]: the state after each row but the last
    num_k_heads: int,
    eps: float,
    *,
    decode: Callable = gdn_decode,
) -> torch.Tensor:
    """Speculative verify (`scheduler/spec/`): each request's rows as consecutive decode
    steps on its slot, the conv window and recurrent state after its row j (but its last) also
    copied to `step_slots[n][j]`; so any prefix of the rows leaves exactly the state decoding
    those tokens one at a time leaves. Returns y [T, value_dim] like `gdn_decode`. This
    reference runs `decode` once per row index, across the requests that have one."""
    out = qkvz.new_empty(qkvz.shape[0], ssm_pool.shape[2] * ssm_pool.shape[4])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)

    def col(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=qkvz.device)

    for j in range(max(lens, default=0)):
        live = [n for n, length in enumerate(lens) if length > j]
        rows = col([starts[n] + j for n in live])
        out[rows] = decode(
            qkvz[rows], ba[rows], conv_pool, ssm_pool, layer, conv_weight, A_log, dt_bias,
            norm_weight, slots[col(live)], num_k_heads, eps,
        )  # fmt: skip
        kept = [n for n in live if j < lens[n] - 1]
        if kept:
            src, dst = slots[col(kept)], col([step_slots[n][j] for n in kept])
            for pool in (conv_pool[layer], ssm_pool[layer]):
                pool.index_copy_(0, dst, pool.index_select(0, src))
    return out
