"""The C++ CPU kernels' unfused ops (kernels/csrc): each keeps its reference's signature and
contract (`kernels.linear`, `multi_linear`, `rmsnorm`, `causal_conv1d`, `gated_delta_rule`,
`experts`; the products add the keyword `bf16_products`) and only reshapes its arguments for
the op.

Load-time contract. `kernels.kernel_set.cpp_set` is chosen only for fp32 activations on the
CPU, matrices in a format the C++ products read (`kernels.weight_formats`: fp32, bf16, int8,
int4), fp32 norms and parameters, and fp32 recurrent states in contiguous pools whose slots the
model passes (`choose(..., state_dtype)`). Nothing here decides per call between C++ and a
reference: an input outside the contract is the op's one-line error. The one choice left by
size is the routed experts' (`ROUTED_MAX_ROWS`), as `hybrid_serve::linear` chooses GEMV or GEMM
by rows.

- `linear`, `linear_multi`: the weight-streaming GEMV up to 8 rows (int8/int4: 64 at the
  AVX-512 levels, 16 at AVX2), the tiled GEMM beyond (decode_ops.h); bf16 widened in
  registers, int8/int4 multiplying the activations rounded to int8 per block of 32
  (`kernels.quant`). `linear_multi` streams every weight in one parallel region.
- `bf16_products=True` (keyword-only, on both): bf16 products at batch, which the set binds
  (`functools.partial`) where the CPU multiplies bf16 in hardware
  (`kernels.kernel_set.bf16_products`): a bf16 matrix, which under the route is K-pair panels
  (`kernels.bf16_pack`, packed by the loader), at `BF16_ROWS` rows or more (every row count)
  multiplies the activations rounded to bf16, each pair product exact, in fp32 sums, the result
  rounded to bf16 and widened: `F.linear(x.bfloat16(), rows).float()` (+ bias in fp32) up to the
  sums' order, by the panel product (bpanel.h, vdpbf16ps where the level has it), whose rows are
  the same bits at every row count. Other formats take the exact products. The choice by rows
  is the C++ `hs::linear`'s, so the decode plan (`hybrid_serve.models.cpu_decode`) makes the
  same one.
- `rms_norm`, `fused_add_rmsnorm`, `rms_norm_gated`: one pass per row (the gated norm rounds as
  the fused GDN decode's, so a prompt's prefill and its decode steps agree).
- `causal_conv1d_update`, `causal_conv1d_fn`: on the conv-state pool, in place, with or without
  a bias, silu or none; padding rows (slot -1, or a slot repeated) get zero output and touch no
  state. The prefill runs every packed sequence in one call, vectorised across channels of the
  token-major input (the model's x is a transposed column slice: no copy), and returns y
  [dim, tokens] as a transposed view.
- `fused_recurrent_gated_delta_rule`, `chunk_gated_delta_rule`: the delta rule on the state
  pool, each (row, value head) state read once and written once in place. The chunked form
  computes the same function token by token on dense blocks of 16 state columns in double
  precision (fp32 round-off grows along a prompt: on the tiny preset's random weights an fp32
  recurrence landed 1.6e-4 from transformers' logits on a 17-token prompt, double 7e-5), with
  the reference's state tracking. Both take the gate g as the reference does: [B, T, HV] or
  per key channel [B, T, HV, K] (KDA).
- `routed_experts`: every active expert's gate/up GEMV, silu(gate) * up (clamped where a
  `limit` is given: `kernels.experts.swiglu`) and down GEMV in two parallel regions, each
  expert's weights streamed once; a row's result does not depend on the other rows.
  With `bf16_products`, bf16 experts are K-pair panels (the loader's, under the route) and take
  the panel product at every row count, past `ROUTED_MAX_ROWS` too (no plain rows to hand to
  torch).
"""

from __future__ import annotations

import torch

from hybrid_serve.kernels import experts, gated_delta_rule
from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID

ops = torch.ops.hybrid_serve  # loaded before this set is chosen (hybrid_serve.kernels.cpp_build)
ROUTED_MAX_ROWS = 256  # beyond, MKL's grouped GEMM (benchmarks/moe_experts.py)
BF16_ROWS = 1  # hs::kBf16Rows (decode_ops.h): the bf16 route at every row count, where on


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous [M, D] (itself when it already is: no view ops at decode sizes)."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


def _shaped(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    bf16_products: bool = False,
) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    y = ops.linear(_rows(x), weight.contiguous(), bf16_products)
    if bias is not None:
        y += bias
    return _shaped(y, x)


def linear_multi(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    *,
    bf16_products: bool = False,
) -> list[torch.Tensor]:
    if x.numel() == 0:
        return [x.new_zeros(*x.shape[:-1], w.shape[0]) for w in weights]
    ys = ops.linear_multi(_rows(x), [w.contiguous() for w in weights], bf16_products)
    for y, b in zip(ys, biases, strict=True):
        if b is not None:
            y += b
    return [_shaped(y, x) for y in ys]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ops.rmsnorm(_rows(x), weight, float(eps)).view(x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return rms_norm(x, weight, eps), x
    y, r = ops.add_rmsnorm(_rows(x), _rows(residual), weight, float(eps))
    return y.view(x.shape), r.view(x.shape)


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return ops.rmsnorm_gated(_rows(x), _rows(z), weight, float(eps)).view(x.shape)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    _check_conv(activation, pad_slot_id)
    return ops.conv1d_update_pool(
        x.contiguous(), conv_state, weight.contiguous(), bias,
        conv_state_indices.long().contiguous(), activation is not None,
    )  # fmt: skip


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
    _check_conv(activation, pad_slot_id)
    rows = x.t()  # [tokens, dim]: the op reads rows at any stride, channels contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = ops.conv1d_varlen_pool(
        rows, conv_states, weight.contiguous(), bias, query_start_loc.long().contiguous(),
        cache_indices.long().contiguous(), has_initial_state.long().contiguous(),
        activation is not None,
    )  # fmt: skip
    return y.t()


def _check_conv(activation: str | None, pad_slot_id: int) -> None:
    if activation not in (None, "silu", "swish") or pad_slot_id != PAD_SLOT_ID:
        raise ValueError(f"C++ conv: silu or no activation and pad slot {PAD_SLOT_ID} only")


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool form: a dense [B, T] batch on `initial_state` (the pool) by
    `initial_state_indices`; a negative or repeated index is padding."""
    if cu_seqlens is not None or initial_state_indices is None:
        raise ValueError("C++ recurrent delta rule: a dense batch on the state pool only")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = ops.gdr_recurrent_pool(
        *(t.contiguous() for t in (q, k, v, g, beta)), initial_state,
        initial_state_indices.long().contiguous(), float(scale), use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return out, None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
    chunk_size: int = 64,
    track_offsets: torch.Tensor | None = None,
    track_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool form (packed with `cu_seqlens`, or dense), states tracked as the reference."""
    if initial_state_indices is None:
        raise ValueError("C++ chunked delta rule: states on the pool only")
    gated_delta_rule.check_tracking(cu_seqlens, initial_state_indices, track_offsets, track_indices)
    B, T = q.shape[:2]
    if cu_seqlens is None:  # a dense batch of B sequences of T tokens, packed
        cu_seqlens = torch.arange(B + 1, dtype=torch.int64) * T
    elif B != 1:
        raise ValueError("varlen inputs are packed into batch 1")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    packed = (t.reshape(1, B * T, *t.shape[2:]).contiguous() for t in (q, k, v, g, beta))
    none = torch.empty(0, dtype=torch.int64)
    out = ops.gdr_varlen_pool(
        *packed, initial_state, cu_seqlens.long().cpu().contiguous(),
        initial_state_indices.long().contiguous(),
        none if track_offsets is None else track_offsets.long().contiguous(),
        none if track_indices is None else track_indices.long().contiguous(),
        float(scale), use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return out.reshape(B, T, *out.shape[2:]), None


def routed_experts(
    xs: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    *,
    limit: float = 0.0,
    bf16_products: bool = False,
) -> torch.Tensor:
    panels = bf16_products and gate_up.dtype == torch.bfloat16  # K-pair panels: the op's, always
    if xs.shape[0] > ROUTED_MAX_ROWS and not panels:
        return experts.routed_experts(xs, gate_up, down, counts, limit=limit)
    return ops.routed_experts(xs.contiguous(), gate_up.contiguous(), down.contiguous(),
                              counts.contiguous(), float(limit), bf16_products)  # fmt: skip
