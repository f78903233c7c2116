"""Gated full attention of one decode step as one C++ CPU op per layer.

Same signature and contract as `kernels.attn_step.attn_decode`. One call replaces the
reference's ~50 torch ops: q/k RMSNorm and RoPE, the KV write, attention over each request's
cached keys (read in place through `req_to_token`, no gather) and the output gate. It covers
fp32 activations, norms and KV buffers; anything else runs the reference.
"""

from __future__ import annotations

import torch

from kernels import attn_step, cpp_build


def attn_decode(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    layer: int,
    out_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    scale: float,
    eps: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    args = (
        qg, k, v, q_norm_w, k_norm_w, cos, sin, k_all, v_all, layer, out_loc, req_to_token,
        req_slots, seq_lens, num_heads, scale, eps, max_seq_len,
    )  # fmt: skip
    ops = cpp_build.load()
    if (
        ops is None
        or not all(t.dtype == torch.float32 for t in (qg, k, v, q_norm_w, k_norm_w, cos, sin))
        or k_all.dtype != torch.float32
        or v_all.dtype != torch.float32
        or not (k_all.is_contiguous() and v_all.is_contiguous())
        or req_to_token.dtype not in (torch.int32, torch.int64)
    ):
        return attn_step.attn_decode(*args)
    return ops.attn_decode(
        qg.contiguous(), k.contiguous(), v.contiguous(), q_norm_w, k_norm_w, cos.contiguous(),
        sin.contiguous(), k_all[layer], v_all[layer], out_loc.long().contiguous(),
        req_to_token.contiguous(), req_slots.long().contiguous(), seq_lens.long().contiguous(),
        num_heads, float(scale), float(eps),
    )  # fmt: skip
