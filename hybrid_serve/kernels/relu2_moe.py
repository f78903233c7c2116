"""NemotronH's MoE block (sigmoid router with a score-correction bias, group-limited top-k,
non-gated relu^2 experts and a shared expert): pure-torch reference op.

    s = sigmoid(x router_w^T)  (fp32);   choice = s + e_score_correction_bias
    groups: the n_group groups of E/n_group experts ranked by the sum of their top-2 choices;
    ids = top_k of choice over the topk_group best groups;   w = s[ids]
    w = w / (sum(w) + 1e-20)  (when norm_topk_prob);   w = w * routed_scaling_factor
    y = sum_k w_k down_{id_k}(relu(up_{id_k} x)^2) + shared_down(relu(shared_up x)^2)

The bias only picks the experts; the weights are the un-biased scores (DeepSeek-V3's router).
Experts are stacked: `experts_up` [E, I, H], `experts_down` [E, H, I]. The routed sum is taken
in fp32 and cast to x's dtype before the shared expert's output is added.

Latent MoE (Nemotron 3 Super, `moe_latent_size` L): the router and the shared expert read x,
the experts its projection into the latent width, and their sum comes back through a second
projection (transformers' `NemotronHMoE` with `fc1_latent_proj` / `fc2_latent_proj`):

    z = latent_in x  [T, L];   y = latent_out (sum_k w_k expert_{id_k}(z)) + shared(x)

with the experts stacked as `experts_up` [E, I, L], `experts_down` [E, L, I].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_serve.kernels.linear import linear as reference_linear


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


def route(
    x: torch.Tensor,  # [T, H]
    router_w: torch.Tensor,  # [E, H]
    correction_bias: torch.Tensor,  # [E]
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, k] fp32, expert ids [T, k]). `scoring` "softmax" takes softmax scores
    over the experts in place of the sigmoid (Kimi's `moe_router_activation_func`); the rest is
    the same (the bias picks, the scores weigh). This DeepSeek-V3 router is every family's with
    a score-correction bias (NemotronH here, Kimi-Linear in `models.kimi_moe`)."""
    T, E = x.shape[0], router_w.shape[0]
    logits = x.float() @ router_w.float().t()  # [T, E]
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"router scores {scoring!r}: sigmoid or softmax")
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores + correction_bias.float()
    per_group = choice.view(T, n_group, E // n_group)
    group_rank = per_group.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # [T, n_group]
    best = group_rank.topk(topk_group, dim=-1, sorted=False).indices
    allowed = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, best, True)
    allowed = allowed.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    ids = choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def relu2_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k]
    topk_w: torch.Tensor,  # [T, k] fp32
    experts_up: torch.Tensor,  # [E, I, H]
    experts_down: torch.Tensor,  # [E, H, I]
    *,
    linear: Callable = reference_linear,
) -> torch.Tensor:
    """sum_k w_k expert_{id_k}(x) [T, H] in fp32: one pair of products per active expert over
    the rows routed to it."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts_up.shape[0]).tolist()
    token_of = order // topk_ids.shape[1]
    weight_of = topk_w.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = token_of[start : start + n]
            y = linear(relu2(linear(x[rows], experts_up[e])), experts_down[e])
            out.index_add_(0, rows, y.float() * weight_of[start : start + n, None])
            start += n
    return out


def relu2_moe(
    x: torch.Tensor,  # [T, H]
    router_w: torch.Tensor,  # [E, H]
    correction_bias: torch.Tensor,  # [E]
    experts_up: torch.Tensor,  # [E, I, H]
    experts_down: torch.Tensor,  # [E, H, I]
    shared_up: torch.Tensor,  # [Is, H]
    shared_down: torch.Tensor,  # [H, Is]
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    latent_in: torch.Tensor | None = None,  # [L, H]: the latent MoE's down projection, or None
    latent_out: torch.Tensor | None = None,  # [H, L]: its up projection (with latent_in)
    *,
    linear: Callable = reference_linear,
) -> torch.Tensor:
    """Returns [T, H] in x's dtype."""
    weights, ids = route(
        x, router_w, correction_bias, top_k, n_group, topk_group, norm_topk_prob, scaling
    )
    z = x if latent_in is None else linear(x, latent_in)
    routed = relu2_experts(z, ids, weights, experts_up, experts_down, linear=linear).to(x.dtype)
    if latent_out is not None:
        routed = linear(routed, latent_out)
    return routed + linear(relu2(linear(x, shared_up)), shared_down)
