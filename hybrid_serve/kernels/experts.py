"""Routed SwiGLU experts: the pure-torch references.

`routed_experts` runs rows already sorted by expert (`kernels.cpp_ops.routed_experts` keeps its
signature: one C++ call for every active expert); `fused_experts` does the routing around it
(sort, gather, weight, scatter), as SGLang's `fused_experts` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_serve.kernels.linear import linear
from hybrid_serve.kernels.quant import is_quantized, round_activations, widen

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # torch._grouped_mm's


def grouped_mm_fits(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: CPU tensors (on CUDA it needs recent
    devices and dtypes, so the experts loop there), weights in the rows' dtype, one it has
    kernels for, and row strides in multiples of 16 bytes (a tensor-parallel shard may not have
    them)."""
    hidden, inter = down.shape[1], down.shape[2]
    return (
        xs.device.type == "cpu"
        and gate_up.dtype == xs.dtype == down.dtype
        and xs.dtype in GROUPED_MM_DTYPES
        and (hidden * xs.element_size()) % 16 == 0
        and (inter * xs.element_size()) % 16 == 0
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) * up; with a `limit` > 0 (Ling-3's late layers, transformers'
    `swiglu_limits`) silu(gate) is capped at `limit` and up clamped to [-limit, limit] first."""
    act = F.silu(gate)
    if limit:
        act, up = act.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return act * up


def routed_experts(
    xs: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    *,
    limit: float = 0.0,
) -> torch.Tensor:
    """xs [T, hidden], the rows of expert e the `counts[e]`-long slice after those of experts
    < e; gate_up [E, 2I, hidden], down [E, hidden, I]; counts [E] int64 summing to T ->
    [T, hidden] in xs' dtype: each row through its expert, down(silu(gate x) * up x). Weights in
    another form (bf16 under fp32 rows, quantized: `kernels.quant`) are widened, and quantized
    ones multiply their inputs rounded to int8 (`kernels.linear.linear`'s products). One
    `torch._grouped_mm` per matrix where it takes the operands (counts stay on the device), else
    one `F.linear` per active expert. `limit`: the clamped SwiGLU (`swiglu`)."""
    if grouped_mm_fits(xs, gate_up, down):
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(swiglu(gate, up, limit), down.transpose(1, 2), offs=offs)
    ys, start = [xs.new_empty(0, xs.shape[1])], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = linear(xs[start : start + n], gate_up[e]).chunk(2, dim=-1)
            ys.append(linear(swiglu(gate, up, limit), down[e]))
            start += n
    return torch.cat(ys)


def fused_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    routed: Callable = routed_experts,
    limit: float = 0.0,
) -> torch.Tensor:
    """x [T, hidden]; topk_ids / topk_w [T, k]; gate_up [E, 2I, hidden], down [E, hidden, I]
    -> sum_k topk_w_k * expert_{id_k}(x) [T, hidden] in x's dtype.

    Sorts the (token, expert) pairs by expert once, gathers the rows in that order, runs
    `routed` (`routed_experts`' contract) on them and scatters the weighted results back with
    one `index_add_`. While a CUDA graph is being captured (no host sync allowed) every expert
    runs on every token instead, weighted by its routing weight (0 where not selected): E/k
    times the FLOPs, for the small captured decode batches only. A `limit` > 0 (the clamped
    SwiGLU, `swiglu`) is passed on to `routed`, which must then take it."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return static_experts(x, topk_ids, topk_w, gate_up, down, limit)
    flat_ids = topk_ids.flatten()  # [T*k]
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0])
    token_of = order // topk_ids.shape[1]
    clamp = {"limit": limit} if limit else {}
    ys = routed(x[token_of], gate_up, down, counts, **clamp)
    ys = ys * topk_w.flatten()[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, ys.to(x.dtype))


def static_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float = 0.0,
) -> torch.Tensor:
    """`fused_experts` with static shapes (no host sync; CUDA-graph capturable)."""
    weights = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    weights.scatter_(1, topk_ids, topk_w.to(x.dtype))  # [T, E]
    rnd = round_activations if is_quantized(gate_up) else (lambda t: t)
    gate, up = torch.einsum("th,eih->eti", rnd(x), widen(gate_up, x.dtype)).chunk(2, dim=-1)
    y = torch.einsum(
        "eti,ehi->eth", rnd(swiglu(gate, up, limit)), widen(down, x.dtype)
    )  # [E, T, hidden]
    return (y * weights.t().unsqueeze(-1)).sum(0)
