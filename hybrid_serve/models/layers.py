"""Building blocks every family's layers share: the kernel-set linear, the norms (zero-centred
for Qwen3-Next / Qwen3.5, plain for the others, gated for Gated DeltaNet's output), the rotary
embedding, the SwiGLU MLP, the stacked experts and the shared-expert sparse MoE.

Numerics follow transformers exactly (fp32 inside the norms, fp32 router softmax), because the
reference model is the judge of this one. Each layer takes its kernels at
construction (`ops`, a `kernels.KernelSet`: the torch references unless the loader chose
others) and calls them; no layer decides per call which implementation runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_serve.kernels import KernelSet, reference_set
from hybrid_serve.kernels.bf16_pack import plain_rows

REFERENCE = reference_set()


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) whose forward is the kernel set's `linear`.
    `keep_float`: weight-only quantization leaves this matrix in its float dtype (the routers'
    gates: their top-k picks must not move)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        ops: KernelSet = REFERENCE,
        keep_float: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ops, self.keep_float = ops, keep_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)

    def rows(self) -> torch.Tensor:
        """The weight [N, K] in row order, for readers other than the kernel set's products
        (under the bf16 route a bf16 weight is K-pair panels: `kernels.bf16_pack`)."""
        return plain_rows(self.weight, self.ops.bf16_products)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x / rms(x) * (1 + w), in fp32, cast back after the scale.
    `add_forward` adds a residual first (SGLang's fused_add_rmsnorm): -> (y, x + residual)."""

    def __init__(self, dim: int, eps: float, ops: KernelSet = REFERENCE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.ops = eps, ops

    def tp_shards(self, config) -> dict[str, None]:
        """Whole on every rank (`models.tp_shards`) unless the module holding it says otherwise."""
        return {"weight": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)


class RMSNormPlain(nn.Module):
    """RMSNorm with a plain weight (NemotronH, Granite, Bamba, Falcon-H1): y = w * x / rms(x),
    the product in fp32, cast back."""

    def __init__(self, dim: int, eps: float, ops: KernelSet = REFERENCE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def tp_shards(self, config) -> dict[str, None]:
        """Whole on every rank (`models.tp_shards`) unless the module holding it says otherwise."""
        return {"weight": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_plain(x, self.weight, self.eps)


class RMSNormGated(nn.Module):
    """Gated DeltaNet output norm: y = w * (x / rms(x)) * silu(z); plain weight, norm first."""

    def __init__(self, dim: int, eps: float, ops: KernelSet = REFERENCE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def tp_shards(self, config) -> dict[str, None]:
        """Whole on every rank (`models.tp_shards`) unless the module holding it says otherwise."""
        return {"weight": None}

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_gated(x, z, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Partial NeoX RoPE angles: cos/sin of the first `rotary_dim` channels of a head, rotated in
    pairs (j, j+rot/2) by `hybrid_serve.kernels.attn_step.apply_rope`."""

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


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: KernelSet = REFERENCE):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, ops=ops)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False, ops=ops)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E routed SwiGLU experts, stacked: gate_up_proj [E, 2I, hidden] ([gate | up] rows),
    down_proj [E, hidden, I] (any I: a tensor-parallel shard stores its slice of the
    intermediate dim). `forward` is the kernel set's `fused_experts`."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, ops: KernelSet = REFERENCE
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.ops = ops

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, limit: float = 0.0
    ) -> torch.Tensor:
        """x [T, hidden]; topk_ids / topk_w [T, k] -> sum_k w_k * expert_{id_k}(x); `limit` > 0:
        the clamped SwiGLU (`kernels.experts.swiglu`)."""
        clamp = {"limit": limit} if limit else {}
        return self.ops.fused_experts(
            x, topk_ids, topk_w, self.gate_up_proj, self.down_proj, **clamp
        )


class SparseMoE(nn.Module):
    """Top-k softmax router over E experts plus a sigmoid-gated shared expert:

        p = softmax(gate(x));  w, ids = topk(p, k)  (w renormalised when norm_topk_prob)
        y = sum_k w_k expert_{ids_k}(x) + sigmoid(shared_expert_gate(x)) shared_expert(x)

    The whole block is one op of the kernel set (`sparse_moe`, reference `kernels.moe_step`;
    on CPU one fused C++ call at decode sizes)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_intermediate_size: int,
        norm_topk_prob: bool,
        ops: KernelSet = REFERENCE,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.ops = top_k, norm_topk_prob, ops
        self.gate = Linear(hidden_size, num_experts, bias=False, ops=ops, keep_float=True)
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size, ops)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size, ops)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False, ops=ops, keep_float=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        shared = self.shared_expert
        return self.ops.sparse_moe(
            x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
            self.shared_expert_gate.weight, shared.gate_proj.weight, shared.up_proj.weight,
            shared.down_proj.weight, self.top_k, self.norm_topk_prob,
        )  # fmt: skip
