"""The sparse MoE block as one C++ CPU op at decode sizes.

Same contract as `kernels.moe_step.sparse_moe`. Up to `MAX_TOKENS` rows (decode batches, short
prefills), one call replaces the reference's ~40 torch ops and Python loop: the router product,
torch's own fp32 softmax and top-k (called from C++, so ties pick the same experts), the active
experts on the rows routed to each, the shared expert and its gate, and the combine. Up to 8 rows
the products are the weight-streaming GEMV on slices of the stacked weights; beyond, the tiled GEMM
and all experts in one routed-experts call (kernels/csrc/routed_experts.cpp). It covers fp32
activations with fp32, bf16 or quantized matrices; longer inputs and anything else run `unfused`
(the reference block over the C++ unfused ops, as `kernels.kernel_set` composes it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.quant import CPP_DTYPES

MAX_TOKENS = 64  # decode batches; longer inputs run the unfused block


def sparse_moe(
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
    *,
    unfused: Callable,
) -> torch.Tensor:
    weights = (
        router_w, experts_gate_up, experts_down, shared_gate_w, shared_gate_proj,
        shared_up_proj, shared_down,
    )  # fmt: skip
    if (
        x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[0] > MAX_TOKENS
        or any(w.dtype not in CPP_DTYPES for w in weights)
    ):
        return unfused(x, *weights, top_k, norm_topk_prob)
    return torch.ops.hybrid_serve.moe_decode(
        x.contiguous(), *(w.contiguous() for w in weights), top_k, norm_topk_prob
    )
