"""Building blocks shared by the Qwen3-Next layers: norms, rotary embedding, MLP and sparse MoE.

Numerics follow transformers' Qwen3-Next exactly (fp32 inside the norms, fp32 router softmax),
because the reference model is the judge of this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import dispatch, experts_cpp, linear_cpp, moe_step_cpp, rms_norm_gated
from kernels.attn_step import apply_rope
from kernels.experts import grouped_mm_fits
from kernels.experts import routed_experts as experts_reference


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) whose forward is the dispatched `kernels.linear`:
    on CPU a weight-streaming GEMV up to 8 rows, a tiled C++ GEMM for decode batches and short
    prefills, a packed C++ GEMM (the same sums) for longer prefill chunks (`kernels.linear_cpp`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x / rms(x) * (1 + w), in fp32, cast back after the scale.
    `add_forward` adds a residual first (SGLang's fused_add_rmsnorm): -> (y, x + residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)


class RMSNormGated(nn.Module):
    """Gated DeltaNet output norm: y = w * (x / rms(x)) * silu(z); plain weight, norm first."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, z, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Partial NeoX RoPE: the first `rotary_dim` channels of a head rotate, pairs (j, j+rot/2)."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        # A plain attribute built on the CPU, so a model constructed on the meta device keeps it.
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim
        self.inv_freq = 1.0 / (theta**exponent)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, rot]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D]; cos/sin [T, rot]."""
        return apply_rope(x, cos, sin)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E routed SwiGLU experts, fused: gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I]
    (any I: a tensor-parallel shard stores its slice of the intermediate dim).

    `forward` sorts the (token, expert) pairs by expert once, gathers the token rows in that
    order, runs the experts on contiguous slices of it and scatters the weighted results back
    with one `index_add_`: no Python work per token. On CPU all experts run in one call
    (`kernels.routed_experts`): where the C++ kernels run (fp32 rows, fp32 or bf16 weights) up
    to `kernels.linear_cpp.GEMM_MAX_ROWS` tokens, since one C++ call for all experts beats the
    per-expert loop from one token on (prefill batches beyond keep MKL's grouped GEMM where it
    takes the operands: fp32 weights); else `torch._grouped_mm` from
    `GROUPED_MIN_TOKENS` tokens where it takes the operands. Otherwise (CUDA, fewer tokens, bf16
    weights without the C++ op) one `kernels.linear` per active expert.
    `benchmarks/moe_experts.py` times these paths against each other."""

    GROUPED_MIN_TOKENS = 32  # torch._grouped_mm against the loop of F.linear (torch kernels)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self._per_expert: tuple[tuple, list[torch.Tensor], list[torch.Tensor]] | None = None

    def per_expert_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One persistent view per expert of each stacked matrix (made once per storage), so
        that the per-step expert loop does not build two new views per active expert."""
        key = (self.gate_up_proj.data_ptr(), self.down_proj.data_ptr())
        if self._per_expert is None or self._per_expert[0] != key:
            gate_up = list(self.gate_up_proj.detach().unbind(0))
            down = list(self.down_proj.detach().unbind(0))
            self._per_expert = (key, gate_up, down)
        return self._per_expert[1], self._per_expert[2]

    def use_grouped(self, x: torch.Tensor) -> bool:
        """One call for all experts (`grouped_experts`) rather than the loop: on CPU, always
        where the C++ op runs, else from `GROUPED_MIN_TOKENS` tokens when `torch._grouped_mm`
        takes the operands (weights in x's dtype, 16-byte rows; a shard may not have them)."""
        if x.is_cuda:
            return False
        if dispatch.use_cpp(x) and experts_cpp.takes(x):
            return True
        return x.shape[0] >= self.GROUPED_MIN_TOKENS and grouped_mm_fits(
            x, self.gate_up_proj, self.down_proj
        )

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden]; topk_ids / topk_w [T, k] -> sum_k w_k * expert_{id_k}(x)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_static(x, topk_ids, topk_w)
        flat_ids = topk_ids.flatten()  # [T*k]
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0])
        token_of = order // topk_ids.shape[1]
        xs = x[token_of]  # the rows of each expert, contiguous, in expert order
        if self.use_grouped(x):
            ys = self.grouped_experts(xs, counts, x.shape[0])
        else:
            ys = self.looped_experts(xs, counts.tolist())
        ys = ys * topk_w.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, ys.to(x.dtype))

    def looped_experts(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """xs [N, hidden] sorted by expert, counts[e] rows each -> expert outputs [N, hidden]."""
        gate_up_w, down_w = self.per_expert_weights()
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = kernels.linear(xs[start : start + n], gate_up_w[e]).chunk(2, dim=-1)
            ys.append(kernels.linear(F.silu(gate) * up, down_w[e]))
            start += n
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def grouped_experts(self, xs: torch.Tensor, counts: torch.Tensor, tokens: int) -> torch.Tensor:
        """The same as `looped_experts`, all experts in one dispatched call (counts stay a
        tensor: no host sync on the reference's grouped-GEMM path). Batches of more tokens than
        the decode batches (`kernels.linear_cpp.GEMM_MAX_ROWS`: prefill) stay on torch's grouped
        GEMM, MKL, where it takes the operands."""
        args = (xs, self.gate_up_proj, self.down_proj, counts)
        if tokens > linear_cpp.GEMM_MAX_ROWS and grouped_mm_fits(*args[:3]):
            return experts_reference(*args)
        return kernels.routed_experts(*args)

    def forward_static(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor
    ) -> torch.Tensor:
        """The same sum with static shapes (no host sync; CUDA-graph capturable): every expert
        runs on every token and is weighted by its routing weight, 0 where not selected. E/k
        times the expert FLOPs, so only for the small decode batches that are captured."""
        E = self.gate_up_proj.shape[0]
        weights = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device)
        weights.scatter_(1, topk_ids, topk_w)  # [T, E]
        gate, up = torch.einsum("th,eih->eti", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.down_proj)  # [E, T, hidden]
        return (y * weights.t().unsqueeze(-1)).sum(0)


class SparseMoE(nn.Module):
    """Top-k softmax router over E experts plus a sigmoid-gated shared expert. On CPU, up to
    `kernels.moe_step_cpp.max_tokens()` tokens (decode batches, short prefills) the whole block
    is one fused op (`kernels.moe_decode`: routing, the active experts, the shared expert, the
    combine)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_intermediate_size: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        if x.shape[0] <= moe_step_cpp.max_tokens() and not x.is_cuda:
            shared = self.shared_expert
            return kernels.moe_decode(
                x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
                self.shared_expert_gate.weight, shared.gate_proj.weight, shared.up_proj.weight,
                shared.down_proj.weight, self.top_k, self.norm_topk_prob,
            )  # fmt: skip
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        topk_w, topk_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        routed = self.experts(x, topk_ids, topk_w.to(x.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
