"""Gated delta rule, recurrent form, as a C++ CPU kernel on the state pool (decode).

Same signature and contract as `kernels.gated_delta_rule.fused_recurrent_gated_delta_rule`.
The C++ kernel covers the decode case: a dense [B, T] batch whose states live in an fp32 pool
(`initial_state` with `initial_state_indices`). Each (row, value head) state is read once,
decayed, updated by the delta rule and read out while it is in cache, and stays in the pool: no
gather into a scratch copy, no scatter back. A row whose index is negative is padding (zero
output, nothing read or written), and so is a row repeating an earlier row's index (only the
reserved padding slot 0 repeats in a decode batch; one thread per state keeps updates
race-free). Every other form (varlen, states without a pool, non-fp32 pools) runs the torch
reference.
"""

from __future__ import annotations

import torch

from kernels import cpp_build, gated_delta_rule


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
    ops = cpp_build.load()
    if (
        ops is None
        or cu_seqlens is not None
        or initial_state_indices is None
        or initial_state is None
        or initial_state.dtype != torch.float32
        or not initial_state.is_contiguous()
    ):
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
