"""The sparse MoE block (router, routed experts, gated shared expert): pure-torch reference op.

    probs = softmax(x router_w^T) in fp32;  topk_w, topk_ids = topk(probs, k)
    topk_w /= sum(topk_w)                                      (when norm_topk_prob)
    y = sum_k topk_w_k expert_{id_k}(x) + sigmoid(x shared_gate_w^T) shared_expert(x)

with SwiGLU experts expert_e(x) = down_e(silu(gate_e(x)) * up_e(x)) from the stacked
`experts_gate_up` [E, 2I, H] ([gate | up] rows) and `experts_down` [E, H, I], and the shared
expert from its own three matrices. The routed outputs are summed, then the gated shared output
added. The products run on the `linear` and `fused_experts` given (by default the references);
matrices may be bf16 under fp32 activations (they are widened). `kernels.cpp_fused.sparse_moe`
runs the whole block as one C++ op at decode sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_serve.kernels.experts import fused_experts as reference_experts
from hybrid_serve.kernels.linear import linear as reference_linear


def sparse_moe(
    x: torch.Tensor,  # [T, H]
    router_w: torch.Tensor,  # [E, H]
    experts_gate_up: torch.Tensor,  # [E, 2I, H]
    experts_down: torch.Tensor,  # [E, H, I]
    shared_gate_w: torch.Tensor,  # [1, H]
    shared_gate_proj: torch.Tensor,  # [Is, H]
    shared_up_proj: torch.Tensor,  # [Is, H]
    shared_down: torch.Tensor,  # [H, Is]
    top_k: int,
    norm_topk_prob: bool,
    *,
    linear: Callable = reference_linear,
    fused_experts: Callable = reference_experts,
) -> torch.Tensor:
    """Returns [T, H] in x's dtype."""
    probs = torch.softmax(linear(x, router_w), dim=-1, dtype=torch.float)
    topk_w, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    routed = fused_experts(x, topk_ids, topk_w.to(x.dtype), experts_gate_up, experts_down)
    shared = linear(F.silu(linear(x, shared_gate_proj)) * linear(x, shared_up_proj), shared_down)
    return routed + torch.sigmoid(linear(x, shared_gate_w)) * shared
