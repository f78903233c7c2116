"""Routed SwiGLU experts over rows already sorted by expert: the pure-torch reference.

`kernels.experts_cpp` keeps this signature (one C++ call for every active expert); the model's
`models.layers.Experts` calls the dispatched `kernels.routed_experts` when `use_grouped` says so
(on CPU: at every size where the C++ op runs, else from `GROUPED_MIN_TOKENS` tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # torch._grouped_mm's


def grouped_mm_fits(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: weights in the rows' dtype, one it has
    kernels for, and row strides in multiples of 16 bytes (a tensor-parallel shard may not have
    them)."""
    hidden, inter = down.shape[1], down.shape[2]
    return (
        gate_up.dtype == xs.dtype == down.dtype
        and xs.dtype in GROUPED_MM_DTYPES
        and (hidden * xs.element_size()) % 16 == 0
        and (inter * xs.element_size()) % 16 == 0
    )


def routed_experts(
    xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """xs [T, hidden], the rows of expert e the `counts[e]`-long slice after those of experts
    < e; gate_up [E, 2I, hidden], down [E, hidden, I]; counts [E] int64 summing to T ->
    [T, hidden] in xs' dtype: each row through its expert, down(silu(gate x) * up x). Weights in
    another dtype (bf16 under fp32 rows) are widened. One `torch._grouped_mm` per matrix where it
    takes the operands (counts stay on the device), else one `F.linear` per active expert."""
    if grouped_mm_fits(xs, gate_up, down):
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    ys, start = [xs.new_empty(0, xs.shape[1])], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(xs[start : start + n], gate_up[e].to(xs.dtype)).chunk(2, dim=-1)
            ys.append(F.linear(F.silu(gate) * up, down[e].to(xs.dtype)))
            start += n
    return torch.cat(ys)
