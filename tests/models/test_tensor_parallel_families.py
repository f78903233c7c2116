"""Tensor parallel (2 ranks, gloo on CPU) for the hybrid families against one rank and
transformers, model level: NemotronH (G = 8: 4 groups a rank, its MoE and MLP widths split),
Granite-4.0-H with and without experts (G = 1: the groups replicated and the gated norm's
variance summed over the ranks), Bamba (partial RoPE), Falcon-H1 (G = 2, the parallel layer,
its muP segment multipliers per rank) and OLMo-Hybrid (Gated DeltaNet read from its separate
tensors, q/k norms over all heads with the rms summed over the ranks; once more with one KV head,
which every rank holds, GDN value/key ratio 2 and a vocabulary two ranks do not divide) and LFM2
(its short conv's channels split, per-head q/k norms whole on every rank; LFM2-MoE's router
whole, its experts' widths split; LFM3's gate rows of each rank's heads, its sliding window)
and Kimi-Linear (KDA heads split with the low-rank gate projections whole, MLA heads split with
the latent row whole, the MoE router whole).
Prefill logits (one shot and in chunks of 48) and greedy decode logits within 1e-4 of tp=1 and
of transformers, the same greedy tokens, and each rank holding little more than half the bytes
(norms, routers, conv and dt parameters of replicated groups are whole or duplicated)."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.parallel import ParallelContext
from tests.families import hf_reference
from tests.hf_reference import hf_greedy
from tests.tp_harness import run_ranks
from tests.tp_workers import each_model_outputs, model_outputs

ATOL = 1e-4
DECODE_STEPS = 6
PRESETS = (
    "tiny-nemotron-h",
    "tiny-nemotron-3-super",
    "tiny-granite-4.0-h",
    "tiny-granite-4.0-h-dense",
    "tiny-bamba",
    "tiny-falcon-h1",
    "tiny-olmo-hybrid",
    "tiny-lfm2",
    "tiny-lfm2-moe",
    "tiny-lfm3",
    "tiny-kimi-linear",
)


def _olmo_one_kv_head() -> dict:
    cfg = preset_config("tiny-olmo-hybrid")
    cfg.update(num_key_value_heads=1, linear_num_value_heads=8, vocab_size=2001)
    return cfg


CHECKPOINTS = {p: preset_config(p) for p in PRESETS} | {"olmo-hybrid-one-kv": _olmo_one_kv_head()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every checkpoint through tp=2 in one launch of the ranks, and through tp=1 here."""
    jobs = []
    for name, config in CHECKPOINTS.items():
        path = write_checkpoint(tmp_path_factory.mktemp(name), config, seed=1)
        gen = torch.Generator().manual_seed(7)
        vocab = config["vocab_size"]
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 150)]
        jobs.append((str(path), prompts))
    two = run_ranks(each_model_outputs, 2, jobs, DECODE_STEPS, 48, timeout_s=400)
    one = [model_outputs(ParallelContext(), *job, DECODE_STEPS, 48) for job in jobs]
    return {p: (*job, a, b) for p, job, a, b in zip(CHECKPOINTS, jobs, one, two, strict=True)}


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
    hf = hf_reference(path)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    assert (two["prefill"] - ref).abs().max().item() < ATOL
    greedy = [list(t) for t in zip(*two["tokens"], strict=True)]
    assert greedy == hf_greedy(hf, prompts, DECODE_STEPS + 1)


def test_each_rank_holds_about_half_the_bytes(outputs):
    _, _, one, two = outputs
    (whole,), ranks = one["rank_param_bytes"], two["rank_param_bytes"]
    assert len(ranks) == 2 and sum(ranks) >= whole
    for share in ranks:
        assert share / whole < 0.52, f"a rank holds {share / whole:.3f} of the model's bytes"
