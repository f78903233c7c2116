"""Gated delta rule, recurrent form, as C++ CPU kernels on the state pool: decode and prefill.

`fused_recurrent_gated_delta_rule` has the signature and contract of
`kernels.gated_delta_rule.fused_recurrent_gated_delta_rule`. Its C++ kernel covers the decode
case: a dense [B, T] batch whose states live in an fp32 pool (`initial_state` with
`initial_state_indices`). Each (row, value head) state is read once, decayed, updated by the
delta rule and read out while it is in cache, and stays in the pool: no gather into a scratch
copy, no scatter back. A row whose index is negative is padding (zero
output, nothing read or written), and so is a row repeating an earlier row's index (only the
reserved padding slot 0 repeats in a decode batch; one thread per state keeps updates
race-free). Every other form (varlen, states without a pool, non-fp32 pools) runs the torch
reference.

`chunk_gated_delta_rule` has the signature and contract of the reference's chunked (WY) form,
state tracking included, and computes the same function token by token (`gdr_varlen_pool`):
one job per (sequence, value head, block of 16 state columns; the columns of a state do not
interact) runs the sequence's tokens in order on a dense copy of its block, which stays in L1,
and writes it back to the pool. It computes in double precision: token by token, fp32
round-off grows along a prompt, and on the tiny preset's ill-conditioned random weights an fp32
recurrence landed 1.6e-4 from transformers' logits on a 17-token prompt (its chunked form
rounds differently), against 7e-5 in double (the torch chunked form: 3e-5; transformers itself
is 5e-5 from a float64 run). Unlike the torch chunked form it has no Python loop over the
sequences of a packed prefill. The pool form only (packed or dense); every other form runs the
torch reference.
"""

from __future__ import annotations

import torch

from kernels import cpp_build, gated_delta_rule


def _pool_ops(initial_state: torch.Tensor | None, initial_state_indices: torch.Tensor | None):
    """The C++ ops for the pool form (an fp32 contiguous state pool with indices), else None."""
    pool_form = (
        initial_state_indices is not None
        and initial_state is not None
        and initial_state.dtype == torch.float32
        and initial_state.is_contiguous()
    )
    return cpp_build.load() if pool_form else None


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
    ops = _pool_ops(initial_state, initial_state_indices)
    if ops is None or cu_seqlens is not None:
        return gated_delta_rule.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, initial_state_indices,
        )  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    in_dtype = q.dtype
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    out = ops.gdr_recurrent_pool(
        q, k, v, g, beta, initial_state, initial_state_indices.long().contiguous(),
        float(scale), use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return out.to(in_dtype), None


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
    ops = _pool_ops(initial_state, initial_state_indices)
    if ops is None:
        return gated_delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, initial_state_indices, chunk_size, track_offsets,
            track_indices,
        )  # fmt: skip
    gated_delta_rule.check_tracking(
        chunk_size, cu_seqlens, initial_state_indices, track_offsets, track_indices
    )
    B, T = q.shape[:2]
    if cu_seqlens is None:  # a dense batch of B sequences of T tokens, packed
        cu_seqlens = torch.arange(B + 1, dtype=torch.int64) * T
    elif B != 1:
        raise ValueError("varlen inputs are packed into batch 1")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    in_dtype = q.dtype
    q, k, v, g, beta = (x.float().reshape(1, B * T, *x.shape[2:]).contiguous()
                        for x in (q, k, v, g, beta))  # fmt: skip
    none = torch.empty(0, dtype=torch.int64)
    out = ops.gdr_varlen_pool(
        q, k, v, g, beta, initial_state, cu_seqlens.long().cpu().contiguous(),
        initial_state_indices.long().contiguous(),
        none if track_offsets is None else track_offsets.long().contiguous(),
        none if track_indices is None else track_indices.long().contiguous(),
        float(scale), use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return out.reshape(B, T, *out.shape[2:]).to(in_dtype), None
