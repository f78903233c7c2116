"""The Kimi MoE block (`models.kimi_moe`) against transformers' `KimiLinearMoE` on random tiny
weights, fp32, with a score-correction bias large enough to move the picks and group-limited
routing (2 groups, 1 picked); the softmax router (which transformers' class does not build)
against a float64 loop of its formula; the TP shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

from hybrid_serve.kernels import choose, reference_set
from hybrid_serve.models.kimi_linear_config import KimiLinearConfig
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.tp_shards import param_shards

RAW = dict(
    model_type="kimi_linear", vocab_size=64, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, intermediate_size=48, kv_lora_rank=8,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    linear_attn_config={"num_heads": 2, "head_dim": 8, "kda_layers": [1], "full_attn_layers": [2]},
    num_experts=8, num_experts_per_token=3, moe_intermediate_size=16, num_shared_experts=2,
    routed_scaling_factor=2.446, num_expert_group=2, topk_group=1, moe_renormalize=True,
    first_k_dense_replace=1,
)  # fmt: skip


def random_block(seed: int, **change) -> tuple[KimiLinearMoE, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    hf = KimiLinearMoE(transformers.KimiLinearConfig(**{**RAW, **change})).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.randn(RAW["num_experts"]) * 0.5)
    return hf, hf.state_dict()


def ours(state, kernels: str = "torch", **change) -> KimiMoE:
    ops = reference_set() if kernels == "torch" else choose("cpu")
    block = KimiMoE(KimiLinearConfig.from_dict({**RAW, **change}), ops=ops)
    block.load_state_dict(state, strict=True)
    return block.eval()


@pytest.mark.parametrize("kernels", ["torch", "cpp"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_block_matches_transformers(kernels: str, renormalize: bool) -> None:
    if kernels == "cpp":
        from tests.kernels.cpp_required import require_cpp

        require_cpp()
    hf, state = random_block(0, moe_renormalize=renormalize)
    block = ours(state, kernels, moe_renormalize=renormalize)
    if kernels == "cpp":
        assert block.experts.ops.backend == "cpp"
    x = torch.randn(11, RAW["hidden_size"])
    with torch.no_grad():
        expect = hf(x.unsqueeze(0))[0]
        got = block(x)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


def test_the_bias_and_the_groups_move_the_picks() -> None:
    """The case above is not vacuous: without the bias, or without groups, other experts win."""
    hf, state = random_block(0)
    x = torch.randn(11, RAW["hidden_size"])
    with torch.no_grad():
        _, _, picked = hf.gate(x)
        unbiased = dict(state)
        unbiased["gate.e_score_correction_bias"] = torch.zeros(RAW["num_experts"])
        hf.load_state_dict(unbiased)
        _, _, without_bias = hf.gate(x)
    assert not torch.equal(picked.sort(-1).values, without_bias.sort(-1).values)
    groups = {int(e) // 4 for e in picked.flatten()}
    per_row = [{int(e) // 4 for e in row} for row in picked]
    assert all(len(g) == 1 for g in per_row) and len(groups) == 2


def test_the_softmax_router_is_its_formula() -> None:
    _, state = random_block(1)
    block = ours(state, moe_router_activation_func="softmax", use_grouped_topk=False)
    x = torch.randn(7, RAW["hidden_size"])
    with torch.no_grad():
        got = block(x)
    xd = x.double()
    sd = {k: v.double() for k, v in state.items()}
    scores = (xd @ sd["gate.weight"].t()).softmax(-1)
    choice = scores + sd["gate.e_score_correction_bias"]
    expect = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        ids = choice[t].argsort(descending=True)[: RAW["num_experts_per_token"]]
        w = scores[t, ids] / (scores[t, ids].sum() + 1e-20) * RAW["routed_scaling_factor"]
        for e, weight in zip(ids.tolist(), w, strict=True):
            gate, up = (sd["experts.gate_up_proj"][e] @ xd[t]).chunk(2)
            expect[t] += weight * (sd["experts.down_proj"][e] @ (F.silu(gate) * up))
    s = "shared_experts."
    shared = F.silu(xd @ sd[s + "gate_proj.weight"].t()) * (xd @ sd[s + "up_proj.weight"].t())
    expect += shared @ sd[s + "down_proj.weight"].t()
    torch.testing.assert_close(got.double(), expect, atol=1e-5, rtol=1e-5)


def test_tensor_parallel_shards() -> None:
    c = KimiLinearConfig.from_dict(RAW)
    whole = dict(KimiMoE(c).named_parameters())
    half = KimiMoE(c, ParallelContext(1, 2))
    shards = param_shards(half, c)
    assert shards["gate.weight"] is None and shards["gate.e_score_correction_bias"] is None
    I, Is = RAW["moe_intermediate_size"], RAW["moe_intermediate_size"] * 2
    assert shards["experts.gate_up_proj"].ranges == ((I // 2, I), (I + I // 2, 2 * I))
    assert shards["shared_experts.down_proj.weight"].ranges == ((Is // 2, Is),)
    for name, p in half.named_parameters():
        shard = shards[name]
        size = whole[name].shape if shard is None else None
        if shard is not None:
            size = list(whole[name].shape)
            size[shard.dim] = sum(b - a for a, b in shard.ranges)
        assert tuple(p.shape) == tuple(size), name
