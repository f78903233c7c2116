"""The C++ CPU kernels' fused decode blocks (kernels/csrc): one op per layer and step where the
reference composes ~30-50 torch ops, each with its reference's signature and contract
(`hybrid_serve.kernels.gdn_step`, `attn_step`, `moe_step`, `mamba2_step`).

- `gdn_decode` / `gdn_verify`: the Gated DeltaNet step after its projections: the conv update
  (silu vectorised across channels), the gates, the l2 norms, the recurrent update in place on
  the pool (each head state read once, updated and read out while in cache) and the gated
  RMSNorm; the verify form runs each request's few rows in order, keeping every step's state.
- `kda_decode`: Kimi Delta Attention's step after its projections (`gdn_decode`'s contract
  with a per-key-channel forget gate, Kimi's or Ling-3's bounded one, and the sigmoid-gated
  norm): the same conv update, l2 norms and in-place recurrent update, the gate computed per
  channel in the head's job.
- `attn_decode`: q/k RMSNorm and RoPE, the KV write, attention over each request's cached keys
  (read in place through `req_to_token`) and the output gate.
- `sparse_moe`: the router, torch's own softmax and top-k (called from C++, so ties pick the same
  experts), the active experts, the shared expert and its gate, and the combine; up to
  `MOE_MAX_TOKENS` rows (decode batches), longer inputs run the set's unfused block.
  With `bf16_products=True` (the set binds it where the CPU has them) every bf16 matrix of the
  block, router, routed and shared experts, is K-pair panels (the loader's) and takes the bf16
  route's panel product at every token count (`kernels.cpp_ops.linear`'s rule with the same
  flag).
- `mamba2_decode` / `mamba2_verify`: the Mamba2 step after its input projection: the conv update
  with its bias, dt's softplus and limit, the state update in place on the pool, the D skip and
  the gate-first grouped RMSNorm.

Load-time contract as `kernels.cpp_ops`': fp32 activations, parameters and contiguous fp32
pools (the set is chosen only then); an input outside it is the op's one-line error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ops = torch.ops.hybrid_serve  # loaded before this set is chosen (hybrid_serve.kernels.cpp_build)
MOE_MAX_TOKENS = 64  # decode batches; longer inputs run the unfused block


def gdn_decode(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    return ops.gdn_decode(
        qkvz.contiguous(), ba.contiguous(), conv_pool[layer], conv_weight.contiguous(),
        ssm_pool[layer], A_log, dt_bias, norm_weight, slots.long().contiguous(), num_k_heads,
        float(eps),
    )  # fmt: skip


def kda_decode(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    eps: float,
    *,
    gate_lower_bound: float | None = None,
) -> torch.Tensor:
    """`gdn_step.gdn_decode` with KDA's gate (`gate_lower_bound`: `gdn_step.gates`') and
    `rms_norm_gated_sigmoid`: qkvz [T, 4 H d] ([q | k | v | z]), ba [T, H + H d] ([b | f])."""
    return ops.kda_decode(
        qkvz.contiguous(), ba.contiguous(), conv_pool[layer], conv_weight.contiguous(),
        ssm_pool[layer], A_log.contiguous(), dt_bias, norm_weight, slots.long().contiguous(),
        float(eps), None if gate_lower_bound is None else float(gate_lower_bound),
    )  # fmt: skip


def verify_rows(lens: list[int], step_slots: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ form of a verify's rows: starts [N+1] (each request's first row), steps [N, w]
    (its step slots, -1 past them), int64 on the CPU."""
    width = max(max(lens, default=1) - 1, 1)
    steps = torch.full((len(lens), width), -1, dtype=torch.int64)
    for n, row in enumerate(step_slots):
        steps[n, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0), steps


def gdn_verify(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    slots: torch.Tensor,
    lens: list[int],
    step_slots: list[list[int]],
    num_k_heads: int,
    eps: float,
) -> torch.Tensor:
    starts, steps = verify_rows(lens, step_slots)
    return ops.gdn_verify(
        qkvz.contiguous(), ba.contiguous(), conv_pool[layer], conv_weight.contiguous(),
        ssm_pool[layer], A_log, dt_bias, norm_weight, slots.long().contiguous(), starts, steps,
        num_k_heads, float(eps),
    )  # fmt: skip


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
    return ops.attn_decode(
        qg.contiguous(), k.contiguous(), v.contiguous(), q_norm_w, k_norm_w, cos.contiguous(),
        sin.contiguous(), k_all[layer], v_all[layer], out_loc.long().contiguous(),
        req_to_token.contiguous(), req_slots.long().contiguous(), seq_lens.long().contiguous(),
        num_heads, float(scale), float(eps),
    )  # fmt: skip


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
    bf16_products: bool = False,
) -> torch.Tensor:
    weights = (
        router_w, experts_gate_up, experts_down, shared_gate_w, shared_gate_proj,
        shared_up_proj, shared_down,
    )  # fmt: skip
    if x.shape[0] > MOE_MAX_TOKENS:
        return unfused(x, *weights, top_k, norm_topk_prob)
    return ops.moe_decode(x.contiguous(), *(w.contiguous() for w in weights), top_k,
                          norm_topk_prob, bf16_products)  # fmt: skip


def mamba2_decode(
    zxbcdt: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor | None,
    slots: torch.Tensor,
    num_groups: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    lo, hi = dt_limit
    return ops.mamba2_decode(
        zxbcdt.contiguous(), conv_pool[layer], conv_weight.contiguous(), conv_bias,
        ssm_pool[layer], A_log, dt_bias, D, norm_weight, slots.long().contiguous(), num_groups,
        float(eps), float(lo), float(hi),
    )  # fmt: skip


def mamba2_verify(
    zxbcdt: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor | None,
    slots: torch.Tensor,
    lens: list[int],
    step_slots: list[list[int]],
    num_groups: int,
    eps: float,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    lo, hi = dt_limit
    starts, steps = verify_rows(lens, step_slots)
    return ops.mamba2_verify(
        zxbcdt.contiguous(), conv_pool[layer], conv_weight.contiguous(), conv_bias,
        ssm_pool[layer], A_log, dt_bias, D, norm_weight, slots.long().contiguous(), starts,
        steps, num_groups, float(eps), float(lo), float(hi),
    )  # fmt: skip
