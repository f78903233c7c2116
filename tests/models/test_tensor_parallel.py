"""Tensor parallel (2 ranks, gloo on CPU) against one rank and transformers, model level.

For the tiny preset, Qwen3.5 dense (split GDN projections) and a checkpoint with a replicated
KV head (4 query heads, 1 KV head), GDN value/key ratio 2, dense and MoE layers, tied embeddings,
fused experts and a vocabulary that two ranks do not divide: prefill logits (one-shot and
chunked) and greedy decode logits within 1e-4 of tp=1 and of transformers, the same greedy
tokens, and each rank holding about half the bytes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from tests.hf_reference import hf_greedy
from tests.tp_harness import run_ranks
from tests.tp_workers import each_model_outputs, model_outputs

ATOL = 1e-4
DECODE_STEPS = 6


def _mixed() -> dict:
    cfg = preset_config("tiny")
    cfg.update(
        num_attention_heads=4,
        num_key_value_heads=1,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        mlp_only_layers=[0, 3],
        tie_word_embeddings=True,
        vocab_size=2001,
        num_hidden_layers=4,
    )
    return cfg


CHECKPOINTS = {
    "tiny": (preset_config("tiny"), "per_expert"),
    "mixed": (_mixed(), "fused"),
    "qwen3.5": (preset_config("tiny-qwen3.5"), "per_expert"),  # split in_proj_qkv/z/b/a
}


QUANTIZED = ("int4", "int8")  # the tiny checkpoint again, quantized at load on each rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both checkpoints through tp=2 in one launch of the ranks, and through tp=1 here."""
    jobs = []
    for name, (config, layout) in CHECKPOINTS.items():
        path = tmp_path_factory.mktemp(f"tp-{name}")
        write_checkpoint(path, config, seed=1, expert_layout=layout)
        gen = torch.Generator().manual_seed(7)
        lens = (1, 40)
        jobs.append(
            (
                str(path),
                [
                    torch.randint(3, config["vocab_size"], (n,), generator=gen).tolist()
                    for n in lens
                ],
            )
        )
    tiny_path, tiny_prompts = jobs[0]
    quantized = [(tiny_path, tiny_prompts, q) for q in QUANTIZED]
    two = run_ranks(each_model_outputs, 2, jobs + quantized, DECODE_STEPS, 16)
    one = [model_outputs(ParallelContext(), *job[:2], DECODE_STEPS, 16, *job[2:])
           for job in jobs + quantized]  # fmt: skip
    return {
        name: (job[0], job[1], a, b)
        for name, job, a, b in zip([*CHECKPOINTS, *QUANTIZED], jobs + quantized, one, two,
                                   strict=True)
    }  # fmt: skip


@pytest.fixture(params=list(CHECKPOINTS))
def outputs(request, runs):
    return runs[request.param]


def test_tp2_logits_equal_tp1(outputs):
    _, _, one, two = outputs
    for key in ("prefill", "chunked", "decode"):
        err = (one[key] - two[key]).abs().max().item()
        assert err < ATOL, f"{key}: max |dlogit| tp=2 vs tp=1 {err:.2e}"
    assert two["tokens"] == one["tokens"]


def test_tp2_matches_transformers(outputs):
    path, prompts, _, two = outputs
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert (two["prefill"] - ref).abs().max().item() < ATOL
    greedy = [list(t) for t in zip(*two["tokens"], strict=True)]
    assert greedy == hf_greedy(hf, prompts, DECODE_STEPS + 1)


def test_each_rank_holds_half_the_sharded_bytes(outputs):
    _, _, one, two = outputs
    (whole,), ranks = one["rank_param_bytes"], two["rank_param_bytes"]
    assert len(ranks) == 2 and sum(ranks) >= whole
    for share in ranks:  # only norms, routers and the gates are whole on both ranks
        assert share / whole < 0.52, f"a rank holds {share / whole:.3f} of the model's bytes"


# How far tp=2's logits may be from tp=1's on the quantized tiny checkpoint, relative: the
# all-reduce sums the partial products in another order, and where an activation's last bit
# differs its rounding to int8 can flip by a step, which the random weights amplify
# (tests/models/test_quantized.py: FLIP_BOUND, the same bound). On the tiny preset drawn from
# transformers' model (issue 56) int8's decode steps differ by 0.115 (prefill 0.037, chunked
# 0.013), past the 0.1 this bound had on the earlier draw; the quantization itself moves the
# logits by 0.54 (int8).
FLIP_BOUND = 0.2


@pytest.mark.parametrize("method", QUANTIZED)
def test_tp2_quantized_equals_tp1(runs, method):
    """Each rank quantizes its own shard to the numbers of the whole matrix (int8: the row scales
    from the whole rows' peaks; int4: the tiny preset's column splits fall on group boundaries,
    as do the activations' blocks of 32), so tp=2 equals tp=1 up to the activations' rounding
    flips; and the quantization did change them."""
    _, _, one, two = runs[method]
    for key in ("prefill", "chunked"):
        assert ((one[key] - two[key]).norm() / one[key].norm()).item() < FLIP_BOUND, key
    # decode step s of a prompt compares while both fed it the same tokens (a flip can turn a
    # near-tie of the greedy choice, and the sequences part there)
    same = (torch.tensor(one["tokens"]) == torch.tensor(two["tokens"])).cumprod(0).bool()[:-1]
    assert same.any()
    a, b = one["decode"][same], two["decode"][same]
    assert ((a - b).norm() / a.norm()).item() < FLIP_BOUND
    assert (one["prefill"][0] - two["prefill"][0]).abs().max().item() < ATOL  # a 1-token prompt
    full = runs["tiny"][2]["prefill"]
    assert ((one["prefill"] - full).norm() / full.norm()).item() > 2 * FLIP_BOUND


def test_splits_replicate_kv_heads_pad_the_vocab_and_refuse_uneven_heads():
    # tiny: 4 query heads, 2 KV heads, GDN 2 key / 4 value heads
    config = Qwen3NextConfig.from_dict({**preset_config("tiny"), "model_type": "qwen3_next"})
    four = [ParallelContext(r, 4) for r in range(4)]
    assert [tp.kv_heads(2) for tp in four] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    ranges = [tp.vocab_range(2001)[:2] for tp in four]
    assert ranges == [(0, 501), (501, 501), (1002, 501), (1503, 498)]
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) is not divisible"):
        ParallelContext(0, 4).local_shapes(config)
    local = ParallelContext(1, 2).local_shapes(config)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert local.conv_dim * 2 == config.conv_dim
