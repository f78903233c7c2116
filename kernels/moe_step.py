"""The sparse MoE block of a decode batch: pure-torch reference op.

    probs = softmax(x router_w^T) in fp32;  topk_w, topk_ids = topk(probs, k)
    topk_w /= sum(topk_w)                                      (when norm_topk_prob)
    y = sum_k topk_w_k expert_{id_k}(x) + sigmoid(x shared_gate_w^T) shared_expert(x)

with SwiGLU experts expert_e(x) = down_e(silu(gate_e(x)) * up_e(x)) from the stacked
`experts_gate_up` [E, 2I, H] ([gate | up] rows) and `experts_down` [E, H, I], and the shared
expert from its own three matrices. The routed outputs are summed in expert order, then the gated
shared output added: the order of `models.layers.SparseMoE`'s unfused path. The experts run as
the per-expert loop of `kernels.linear` up to `SKINNY_ROWS` tokens (where each expert's rows take
the weight-streaming GEMV on CPU, `kernels.linear_cpp`) and as one dispatched
`kernels.routed_experts` beyond (as `Experts.grouped_experts`), the choice
`kernels.moe_step_cpp`'s C++ op makes too. Matrices may be bf16 under fp32 activations
(`kernels.linear` widens them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.linear_cpp import SKINNY_ROWS


def moe_decode(
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
) -> torch.Tensor:
    """Returns [T, H] in x's dtype."""
    import kernels

    probs = torch.softmax(kernels.linear(x, router_w), dim=-1, dtype=torch.float)
    topk_w, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    xs = x[token_of]  # rows in expert order
    counts = torch.bincount(flat_ids, minlength=experts_gate_up.shape[0])
    if x.shape[0] > SKINNY_ROWS:
        y = kernels.routed_experts(xs, experts_gate_up, experts_down, counts)
    else:
        ys, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = kernels.linear(xs[start : start + n], experts_gate_up[e]).chunk(2, -1)
                ys.append(kernels.linear(F.silu(gate) * up, experts_down[e]))
                start += n
        y = torch.cat(ys)
    y = y * topk_w.flatten()[order, None].to(x.dtype)
    routed = torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))
    shared = kernels.linear(
        F.silu(kernels.linear(x, shared_gate_proj)) * kernels.linear(x, shared_up_proj),
        shared_down,
    )
    return routed + torch.sigmoid(kernels.linear(x, shared_gate_w)) * shared
