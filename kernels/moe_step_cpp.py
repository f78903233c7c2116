"""The sparse MoE block of a decode batch as one C++ CPU op.

Same signature and contract as `kernels.moe_step.moe_decode`. One call replaces the reference's
~40 torch ops and Python loop: the router product, torch's own fp32 softmax and top-k (called
from C++, so ties pick the same experts), the active experts on the rows routed to each, the
shared expert and its gate, and the combine. Up to `linear_cpp.SKINNY_ROWS` rows the products are
the weight-streaming GEMV on slices of the stacked weights; beyond, the tiled GEMM and all
experts in one routed-experts call (kernels/csrc/gemm.cpp), as the reference picks them. It
covers fp32 activations with fp32 or bf16 matrices, at most `max_tokens()` rows: the C++ GEMM's
decode rows (`kernels.linear_cpp.GEMM_MAX_ROWS`) while it is on, the GEMV's block while
`HYBRID_SERVE_CPU_GEMM=off`; anything else runs the reference.
"""

from __future__ import annotations

import torch

from kernels import cpp_build, linear_cpp, moe_step

MAX_TOKENS = linear_cpp.GEMM_MAX_ROWS  # decode batches; longer prefill chunks run the unfused block


def max_tokens() -> int:
    """The most rows the C++ op takes now (`linear_cpp.GEMM_ON` may be flipped between runs)."""
    return MAX_TOKENS if linear_cpp.GEMM_ON else linear_cpp.SKINNY_ROWS


def moe_decode(
    x: torch.Tensor,
    router_w: torch.Tensor,
    experts_gate_up: torch.Tensor,
    experts_down: torch.Tensor,
    shared_gate_w: torch.Tensor,
    shared_gate_proj: torch.Tensor,
    shared_up_proj: torch.Tensor,
    shared_down: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
) -> torch.Tensor:
    weights = (
        router_w, experts_gate_up, experts_down, shared_gate_w, shared_gate_proj,
        shared_up_proj, shared_down,
    )  # fmt: skip
    ops = cpp_build.load()
    if (
        ops is None
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[0] > max_tokens()
        or any(w.dtype not in (torch.float32, torch.bfloat16) for w in weights)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)))
    ):
        return moe_step.moe_decode(x, *weights, top_k, norm_topk_prob)
    return ops.moe_decode(x.contiguous(), *(w.contiguous() for w in weights), top_k, norm_topk_prob)
