"""Speculative decoding (NEXTN) from Ling-3's block-FP8 checkpoint (`make-model --fp8` of
`tiny-bailing-hybrid`: the main layers and the MTP layer in FP8, dequantized at load on the CPU)
through the Engine with the radix cache on: greedy outputs are plain decoding's tokens of the
same checkpoint, batched with accepted and rejected drafts (`controlled`), again when the same
prompts come back and hit the cache, and the pools stay clean. Served in fp32, where every row
count gives the same products (bf16 switches products by row count: `docs/precision.md`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.fp8 import E4M3
from hybrid_serve.scheduler.engine import Engine
from tests.scheduler.test_speculative import FREE, GREEDY, NEW, POOLS, SPEC, controlled

PRESET = "tiny-bailing-hybrid"
SERVE = {**POOLS, "dtype": "float32"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The FP8 checkpoint, its prompts (two share a 64-token prefix) and plain decoding's
    tokens for them."""
    config = preset_config(PRESET)
    path = write_checkpoint(
        tmp_path_factory.mktemp("ling3fp8"),
        config,
        seed=5,
        dtype=torch.bfloat16,
        fp8_block=(128, 128),
    )
    stored = load_file(str(path / "model.safetensors"))
    assert stored["model.layers.6.eh_proj.weight"].dtype == E4M3  # the MTP layer is FP8 too
    gen = torch.Generator().manual_seed(4)
    vocab = config["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (6, 19, 70)]
    prompts.append(prompts[2][:64] + prompts[0])
    plain = Engine(str(path), **SERVE, disable_radix_cache=True)
    expected = [o["output_ids"] for o in plain.generate(prompts, {**GREEDY, "max_new_tokens": 24})]
    return str(path), prompts, expected, vocab


def test_fp8_greedy_speculation_equals_plain_decoding_with_the_radix_cache(ckpt) -> None:
    path, prompts, expected, vocab = ckpt
    engine = Engine(path, **SERVE, **SPEC)
    engine.scheduler.forward.policy.costs = FREE
    head = engine.runner.model.mtp
    assert type(head).__name__ == "BailingHybridMultiTokenPredictor"
    # the head's own drafts, one request at a time
    assert engine.generate(prompts[1], GREEDY)["output_ids"] == expected[1][:NEW]
    # controlled acceptance, batched: accepted and rejected drafts in every round
    for p_bad in (0.0, 0.5):
        spec = controlled(engine, prompts, expected, vocab, p_bad)
        spec.accepted = 0
        outs = engine.generate(prompts, GREEDY)
        assert [o["output_ids"] for o in outs] == [e[:NEW] for e in expected], p_bad
        assert spec.accepted > 0
        assert engine.leak_report() == []
    # the same prompts again, longer: they hit the cache and speculation goes on from there
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 24})
    assert [o["output_ids"] for o in outs] == expected
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[2] >= 64 and cached[3] >= 64, cached
    assert engine.scheduler.tree.sanity_check() is None
    assert engine.leak_report() == []
