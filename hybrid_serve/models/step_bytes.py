"""What one decode step must read from memory: the bytes behind the HBM roofline.

Pure arithmetic over a `Qwen3NextConfig` (the model is built on the `meta` device to take its own
parameter shapes; nothing is allocated). For a decode step of `batch` requests whose caches hold
`context` tokens each:

    weights  dense parameters once (attention, GDN, norms, routers, shared experts, dense MLPs,
             the LM head) + one embedding row per request (none when the embedding is the
             tied LM head, read whole already)
             + per MoE layer the expected number of distinct routed experts the batch touches,
               E * (1 - (1 - k/E)^batch) (each token picks k of E uniformly, independently),
               times the bytes of one expert (gate, up and down: 3 x I x hidden)
    kv       batch x context x KV bytes per token (K and V of every full-attention layer, read)
    state    2 x batch x Mamba state bytes per request (every linear layer's conv window of
             Kc - 1 columns and its fp32 recurrent state, read and written back)

The roofline step time is their sum over the device's memory bandwidth: no step can be faster.
Activations and the per-token writes of one new KV row are left out (under 1% at batch <= 256).

With a block-FP8 `quantization_config` (`fp8`) the matrices a load keeps FP8
(`models.fp8_resident`: every linear layer and expert stack its ignore list does not name) count
one byte per weight plus their block scales (4 bytes per bn x bk block), the rest the serving
dtype's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from hybrid_serve.models.fp8 import Fp8Config
from hybrid_serve.models.fp8_resident import dummy_plan
from hybrid_serve.models.layers import Experts
from hybrid_serve.models.loader import matrices
from hybrid_serve.models.qwen3_next import Qwen3NextForCausalLM
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.weight_map import checkpoint_map

SSM_STATE_BYTES = 4  # the recurrent state is fp32 (mamba_ssm_dtype float32)


@dataclass(frozen=True)
class ParamGroups:
    """Parameters by how a decode step reads them."""

    dense: int  # read once per step (the LM head included, tied or not)
    embedding: int  # the input embedding table (one row per request is read); 0 when tied
    per_expert: int  # one routed expert of one MoE layer (3 x I x hidden)
    moe_layers: int
    num_experts: int
    experts_per_tok: int
    hidden: int
    dense_fp8: int = 0  # of `dense`, the parameters kept block-FP8
    experts_fp8: bool = False  # the routed experts kept block-FP8
    fp8_bytes: float = 1.0  # bytes per FP8 weight: one, plus its share of a block's scale

    @property
    def total(self) -> int:
        return self.dense + self.embedding + self.per_expert * self.moe_layers * self.num_experts

    def resident_bytes(self, weight_bytes: int = 2) -> float:
        """Bytes the parameters hold on the device: FP8 ones at `fp8_bytes`, the rest at
        `weight_bytes`."""
        experts = self.per_expert * self.moe_layers * self.num_experts
        fp8 = self.dense_fp8 + experts * self.experts_fp8
        return (self.total - fp8) * weight_bytes + fp8 * self.fp8_bytes


@dataclass(frozen=True)
class StepBytes:
    weights: float
    kv: float
    state: float

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.state

    def seconds(self, bandwidth: float) -> float:
        """The roofline step time at `bandwidth` bytes/s."""
        return self.total / bandwidth


@cache
def param_groups(config: Qwen3NextConfig, fp8: Fp8Config | None = None) -> ParamGroups:
    """`config`'s parameters grouped by how a decode step reads them (meta-device model); with
    `fp8`, which of them a load keeps block-FP8 (module docstring)."""
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    expert_ids = {id(p) for m in experts for p in (m.gate_up_proj, m.down_proj)}
    embed = model.model.embed_tokens.weight
    dense = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids and p is not embed)
    tied = model.lm_head.weight is embed
    per_expert = 3 * config.moe_intermediate_size * config.hidden_size if experts else 0
    kept = _fp8_params(model, fp8) if fp8 is not None else {}
    fp8_groups = {}
    if fp8 is not None:
        fp8_groups = dict(
            dense_fp8=sum(p.numel() for p in kept.values() if id(p) not in expert_ids),
            experts_fp8=any(id(p) in expert_ids for p in kept.values()),
            fp8_bytes=1.0 + 4.0 / (fp8.block[0] * fp8.block[1]),
        )
    return ParamGroups(
        dense=dense + (embed.numel() if tied else 0),
        embedding=0 if tied else embed.numel(),
        per_expert=per_expert,
        moe_layers=len(experts),
        num_experts=config.num_experts if experts else 0,
        experts_per_tok=config.num_experts_per_tok if experts else 0,
        hidden=config.hidden_size,
        **fp8_groups,
    )


def _fp8_params(model: Qwen3NextForCausalLM, fp8: Fp8Config) -> dict[str, torch.Tensor]:
    """The parameters of (meta) `model` a load with `fp8`'s quantization_config keeps FP8."""
    params = dict(model.named_parameters())
    ids = {id(p) for p in matrices(model)} - {id(model.model.embed_tokens.weight)}
    mats = {n for n, p in params.items() if id(p) in ids}
    names = dummy_plan(params, mats, checkpoint_map(model), fp8)
    return {n: params[n] for n in names}


def kv_bytes_per_token(config: Qwen3NextConfig, cache_bytes: int = 2) -> int:
    """K and V of every full-attention layer for one token."""
    per_layer = 2 * config.num_key_value_heads * config.head_dim * cache_bytes
    return len(config.full_attention_layers) * per_layer


def state_bytes_per_request(config: Qwen3NextConfig, conv_bytes: int = 2) -> int:
    """One request's Mamba state: per linear layer the conv window (conv_dim x (Kc - 1) in the
    cache dtype) and the fp32 recurrent state (HV x dk x dv)."""
    conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * conv_bytes
    ssm = (
        config.linear_num_value_heads
        * config.linear_key_head_dim
        * config.linear_value_head_dim
        * SSM_STATE_BYTES
    )
    return len(config.linear_attention_layers) * (conv + ssm)


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts `batch` tokens touch, each choosing `top_k` of `num_experts`."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_step_bytes(
    config: Qwen3NextConfig,
    batch: int,
    context: int,
    weight_bytes: int = 2,
    cache_bytes: int = 2,
    fp8: Fp8Config | None = None,
) -> StepBytes:
    """Bytes one decode step of `batch` requests with `context` cached tokens each must move;
    weights in `weight_bytes` per parameter (block-FP8 ones, with `fp8`, at one byte plus
    scales), KV and conv windows in `cache_bytes`."""
    g = param_groups(config, fp8)
    experts = g.moe_layers * expected_experts(g.num_experts, g.experts_per_tok, batch)
    rows = min(batch, config.vocab_size) * g.hidden if g.embedding else 0
    expert_bytes = g.fp8_bytes if g.experts_fp8 else weight_bytes
    dense = (g.dense - g.dense_fp8) * weight_bytes + g.dense_fp8 * g.fp8_bytes
    weights = dense + experts * g.per_expert * expert_bytes + rows * weight_bytes
    kv = batch * context * kv_bytes_per_token(config, cache_bytes)
    state = 2 * batch * state_bytes_per_request(config, cache_bytes)
    return StepBytes(float(weights), float(kv), float(state))


def weight_bytes_per_step(model: nn.Module) -> Callable[[int], float]:
    """rows -> the bytes of weights a decode step of `rows` requests reads (`StepBytes.weights`)
    for a loaded model of any family, at 2 bytes a weight: a Qwen3-Next / Qwen3.5 config through
    `decode_step_bytes`; any other from the model's own parameters, its MTP head's left out:
    every parameter once, but each routed-expert stack (a parameter [num_experts, ., .]) for the
    expected number of distinct experts `rows` tokens touch (`expected_experts`, the config's
    `num_experts_per_tok`), and an untied input embedding one row per request."""
    config = model.config
    if isinstance(config, Qwen3NextConfig):
        return lambda rows: decode_step_bytes(config, rows, 0).weights
    head = {id(p) for p in model.mtp.parameters()} if model.mtp is not None else set()
    params = [p for p in model.parameters() if id(p) not in head]
    embed = model.embed_tokens.weight
    tied = any(p is embed for p in model.lm_head.parameters())
    n, top_k = getattr(config, "num_experts", 0), getattr(config, "num_experts_per_tok", 0)
    stacks = [p for p in params if n and p.dim() == 3 and p.shape[0] == n]
    stack_ids = {id(p) for p in stacks}
    dense = sum(p.numel() for p in params if id(p) not in stack_ids and (tied or p is not embed))

    def weights(rows: int) -> float:
        experts = sum(expected_experts(p.shape[0], top_k, rows) * p[0].numel() for p in stacks)
        row = 0 if tied else min(rows, embed.shape[0]) * embed.shape[1]
        return 2.0 * (dense + experts + row)

    return weights
