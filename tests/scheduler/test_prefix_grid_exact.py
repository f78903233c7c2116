"""A request served from a 64-token grid snapshot (a prefix hit) gets bit for bit the logits of
the same request served uncached (the radix cache off), in fp32 through the CPU kernel set, for
one tiny preset of each recurrent mixer kind: Gated DeltaNet (tiny, Qwen3-Next), Mamba2
(tiny-nemotron-h), KDA (tiny-kimi-linear) and the gated short conv (tiny-lfm2).

The cached engine serves a prompt of a 512-token prefix and 40 more tokens, which leaves the
state at 512 in the tree (`tests/scheduler/test_prefix_grid.py`: snapshots land on the grid),
then a second prompt of the same prefix and 30 other tokens, which resumes from that state and
computes its 30 tokens. Uncached, that prompt is computed twice: in two prefill rounds split
where the snapshot is (chunks of 512 tokens), and in one round of 542 tokens. The logits of the
prompt's last token are compared where the sampler reads them (`logits_from_hidden`).

Split at the snapshot, the logits are equal (torch.equal) for every kind. In one round they are
for the short conv only, and within 1e-5 for the others, for two reasons the one round does not
share with the resumed 30-token round:

- the C++ delta rule (GDN and KDA: `kernels/csrc/delta_rule_pool.cpp`) carries a sequence's
  state in double precision through a round and rounds it to fp32 only where it stores it (a
  snapshot, a round's end): the resumed round starts from the fp32 state at 512, the one round
  goes on past 512 from the unrounded one;
- the MoE blocks' expert products are chosen by how many rows a round routes to an expert
  (tiny, tiny-nemotron-h and tiny-kimi-linear have experts), and the choices sum in different
  orders: NemotronH's relu^2 experts go through the C++ `linear`, a GEMV up to 8 rows and a tiled
  GEMM beyond, and the SwiGLU experts through the C++ routed kernel up to
  `kernels.cpp_ops.ROUTED_MAX_ROWS` (256) routed rows and MKL's grouped GEMM beyond: a token's
  expert outputs round differently among 30 tokens than among 542.

tiny-lfm2 has neither (a conv window in fp32, dense MLPs)."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels.cpp_ops import ROUTED_MAX_ROWS
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine

GRID, SHARED, FIRST, SECOND = 64, 512, 40, 30
ONE = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
POOLS = {"max_running_requests": 2, "max_total_tokens": 2048}
# preset -> whether one uncached round is bit for bit the resumed round too (module docstring)
PRESETS = {"tiny": False, "tiny-nemotron-h": False, "tiny-kimi-linear": False, "tiny-lfm2": True}


def recording_engine(path: str, **options) -> tuple[Engine, list[torch.Tensor]]:
    """An engine, and the list into which each call's logits go as the forward step computes
    them from final hidden states (one row per request here: one request at a time)."""
    engine = Engine(path, **POOLS, **options)
    model, seen = engine.runner.model, []
    compute = model.logits_from_hidden

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        seen.append(logits.clone())
        return logits

    model.logits_from_hidden = recording
    return engine, seen


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_snapshot_hit_gives_the_uncached_logits_bit_for_bit(tmp_path, kernels_mode, preset):
    kernels_mode("cpp")  # the CPU kernel set, whatever the environment asks
    config = preset_config(preset)
    path = str(write_checkpoint(tmp_path, config, seed=3))
    gen = torch.Generator().manual_seed(11)
    shared, first, second = (
        torch.randint(3, config["vocab_size"], (n,), generator=gen).tolist()
        for n in (SHARED, FIRST, SECOND)
    )
    assert SHARED % GRID == 0 and SECOND < ROUTED_MAX_ROWS < SHARED + SECOND
    cached, hits = recording_engine(path)
    backends = {m.ops.backend for m in cached.runner.model.modules() if hasattr(m, "ops")}
    assert backends == {"cpp"}, backends  # the CPU kernel set
    cached.generate(shared + first, ONE)
    out = cached.generate(shared + second, ONE)
    assert out["meta_info"]["cached_tokens"] == SHARED  # resumed from the grid snapshot at 512
    assert cached.leak_report() == []
    split, rounds = recording_engine(path, disable_radix_cache=True, chunked_prefill_size=SHARED)
    whole, one_round = recording_engine(path, disable_radix_cache=True)
    for engine, seen in ((split, rounds), (whole, one_round)):
        again = engine.generate(shared + second, ONE)
        assert again["meta_info"]["cached_tokens"] == 0
        assert again["output_ids"] == out["output_ids"]
        assert seen[-1].shape == (1, config["vocab_size"]) and seen[-1].dtype == torch.float32
        assert engine.leak_report() == []
    assert len(rounds) == 2  # the rounds [0, 512) and [512, 542), each ending in its logits
    assert torch.equal(hits[-1], rounds[-1]), (hits[-1] - rounds[-1]).abs().max()
    if PRESETS[preset]:
        assert torch.equal(hits[-1], one_round[-1]), (hits[-1] - one_round[-1]).abs().max()
    else:
        torch.testing.assert_close(hits[-1], one_round[-1], atol=1e-5, rtol=0)
