"""The lockstep engine: `Engine(tp_size=2)` (this process is rank 0, one spawned follower, gloo)
gives the tokens of `Engine()` and of transformers, with the radix cache, chunked prefill, a
session, seeded and unseeded sampling, under no_buffer and extra_buffer (and for each hybrid
family); every rank's pools are clean afterwards; a follower that dies stops the group with a
message naming it. Every rank's state agrees after every kind of input, a mutating query the
lockstep layer never heard of included."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.lockstep import RankLost
from tests.hf_reference import hf_greedy
from tests.scheduler.helpers import FixedCosts
from tests.tp_harness import run_ranks
from tests.tp_workers import config_mismatch, lockstep_workload

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
POOLS = dict(
    dtype="float32",
    max_running_requests=6,
    max_total_tokens=1024,
    chunked_prefill_size=64,  # the 145-token prompts take three rounds
    mamba_track_interval=4,
)


def _mixed() -> dict:  # one replicated KV head, GDN ratio 2, dense and MoE layers
    cfg = preset_config("tiny")
    cfg.update(num_key_value_heads=1, mlp_only_layers=[0, 3], num_hidden_layers=4, vocab_size=2001)
    return cfg


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, cfg in (("tiny", preset_config("tiny")), ("mixed", _mixed())):
        out[name] = str(write_checkpoint(tmp_path_factory.mktemp(f"tp-{name}"), cfg, seed=3))
    return out


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (length,), generator=gen).tolist() for _ in range(n)]


def _workload(engine: Engine) -> dict:
    """Shared-prefix prompts twice (the second round hits the cache), one prompt again (served
    whole), a two-turn session and sampled requests (one seeded); the tokens, the cache hits and
    every rank's leak report."""
    prefix = _prompts(1, 140, 1)[0]  # past one 64-token chunk: extra_buffer snapshots there
    first = [prefix + tail for tail in _prompts(3, 5, 2)]
    out = {"round1": [r["output_ids"] for r in engine.generate(first, GREEDY)]}
    second = engine.generate([prefix + tail for tail in _prompts(2, 7, 3)], GREEDY)
    out["round2"] = [r["output_ids"] for r in second]
    out["cached"] = [r["meta_info"]["cached_tokens"] for r in second]
    repeat = engine.generate(first[0], GREEDY)  # an exact repeat: logits from the kept hidden
    out["repeat"] = (repeat["output_ids"], repeat["meta_info"]["cached_tokens"])
    sid = engine.open_session(capacity_of_str_len=1000)
    turns = []
    for i, turn in enumerate(_prompts(2, 9, 4)):
        params = {"id": sid, "rid": turns[-1][0] if turns else None}
        res = engine.generate(turn, GREEDY, session_params=params)
        turns.append((res["meta_info"]["id"], res["output_ids"], i))
    engine.close_session(sid)
    out["session"] = [t[1] for t in turns]
    sampled = engine.generate(
        _prompts(2, 12, 5),
        [
            {"max_new_tokens": 6, "temperature": 0.9, "seed": 11},
            {"max_new_tokens": 6, "temperature": 0.9},
        ],
    )
    out["seeded"] = sampled[0]["output_ids"]
    out["leaks"] = engine.leak_report()
    return out


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_tp2_engine_equals_tp1(paths, strategy):
    tp2 = Engine(paths["tiny"], tp_size=2, mamba_scheduler_strategy=strategy, **POOLS)
    try:
        two = _workload(tp2)
    finally:
        tp2.shutdown()
    one = _workload(Engine(paths["tiny"], mamba_scheduler_strategy=strategy, **POOLS))
    assert two["leaks"] == [] and one["leaks"] == []
    assert min(two["cached"]) >= 64, two["cached"]  # the shared prefix came from the cache
    assert two["repeat"] == (two["round1"][0], 145)
    for key in ("round1", "round2", "cached", "repeat", "session", "seeded"):
        assert two[key] == one[key], key


@pytest.mark.parametrize(
    "preset",
    [
        "tiny-nemotron-h", "tiny-granite-4.0-h", "tiny-falcon-h1", "tiny-olmo-hybrid",
        "tiny-lfm2", "tiny-lfm2-moe", "tiny-lfm3",
    ],
)  # fmt: skip
def test_tp2_engine_equals_tp1_for_the_hybrid_families(preset, tmp_path):
    """The same workload on each hybrid family (groups split for NemotronH, replicated with the
    norm's variance summed for Granite and Bamba, the parallel layer of Falcon-H1, OLMo-Hybrid's
    GDN and q/k norms over all heads, the short convs' channels split for LFM2, LFM2-MoE and
    LFM3, LFM3's sliding window and gate per rank's heads) under extra_buffer: tp=2 gives tp=1's
    tokens and cache hits, every rank's pools clean."""
    path = str(write_checkpoint(tmp_path / preset, preset_config(preset), seed=3))
    options = {"mamba_scheduler_strategy": "extra_buffer", **POOLS}
    tp2 = Engine(path, tp_size=2, **options)
    try:
        two = _workload(tp2)
    finally:
        tp2.shutdown()
    one = _workload(Engine(path, **options))
    assert two["leaks"] == [] and one["leaks"] == []
    assert min(two["cached"]) >= 64 and two["repeat"][1] == 145
    for key in ("round1", "round2", "cached", "repeat", "session", "seeded"):
        assert two[key] == one[key], key


def test_tp2_engine_matches_transformers_and_a_dead_rank_stops_it(paths):
    prompts = _prompts(3, 21, 6)
    engine = Engine(paths["mixed"], tp_size=2, mamba_scheduler_strategy="extra_buffer", **POOLS)
    try:
        got = [r["output_ids"] for r in engine.generate(prompts, GREEDY)]
        assert engine.leak_report() == []
        (proc,) = engine.tp_group.procs.values()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with pytest.raises(RankLost, match=r"rank 1 exited \(code -9\)"):
            engine.generate(_prompts(1, 8, 8), GREEDY)
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(paths["mixed"], dtype=torch.float32).eval()
    assert got == hf_greedy(hf, prompts, GREEDY["max_new_tokens"])


def test_ranks_started_with_other_options_refuse_to_run():
    message = run_ranks(config_mismatch, 2)
    assert "rank 1 runs with max_total_tokens=2048, this rank with 1024" in message


def test_ranks_agree_after_every_kind_of_input(paths):
    out = run_ranks(lockstep_workload, 2, paths["tiny"])
    for rank0, rank1 in out["states"]:
        assert rank0 == rank1
        assert rank0["leaks"] == []
    held = [rank0["sessions"].get(out["sid"]) for rank0, _ in out["states"]]
    assert held == [None, True, False, True, None, None]  # evicted by the query; expired
    assert out["states"][-1][0]["cached"] == [0, 0]  # flushed
    last = out["last"]
    assert last["a"] == ("abort", None) and last["b"][0] == "stop"
    assert last["t3"] == ("abort", f"session {out['sid']!r} timed out")


@pytest.mark.parametrize("preset", ["tiny", "tiny-nemotron-3-super", "tiny-bailing-hybrid"])
def test_tp2_speculative_equals_tp1_speculative(tmp_path, preset):
    """NEXTN under tensor parallelism: every rank drafts the same tokens from the gathered
    logits (as many as rank 0's draft-length policy chose) and lands the same ones; sampled
    requests draft too, rank 0 drawing their drafts and running the rejection test for all
    ranks. The tokens are tp=1 NEXTN's: greedy ones plain decoding's (tests/scheduler/
    test_speculative.py, test_nemotron_h_speculative.py), seeded sampled ones drawn the same
    way. Qwen3-Next's head, Nemotron 3 Super's (latent MoE) and Ling-3's (MLA + MoE); the last two
    presets have theirs."""
    cfg = preset_config(preset) | ({"mtp_num_hidden_layers": 1} if preset == "tiny" else {})
    path = str(write_checkpoint(tmp_path / "tp-mtp", cfg, seed=3))
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
    seeded = {"max_new_tokens": 8, "temperature": 0.9, "seed": 5}
    prompt = _prompts(1, 12, 6)[0]

    def run(tp_size: int) -> tuple[dict, list[int], int]:
        engine = Engine(
            path, tp_size=tp_size, mamba_scheduler_strategy="extra_buffer", **spec, **POOLS
        )
        # rank 0 chooses the draft lengths for every rank: drafting free there, N drafts a round
        engine.scheduler.forward.policy.costs = FixedCosts(
            lambda b: 1.0, lambda r, b: 1.0, lambda r: 0.0
        )
        try:
            out = _workload(engine)
            before = engine.scheduler.forward.drafted
            alone = engine.generate(prompt, seeded)["output_ids"]
            drafted = engine.scheduler.forward.drafted - before
            out["leaks"] = engine.leak_report()
        finally:
            engine.shutdown()
        return out, alone, drafted

    two, two_alone, two_drafted = run(2)
    one, one_alone, _ = run(1)
    assert two["leaks"] == [] and two_drafted > 0  # the sampled request drafted
    for key in ("round1", "round2", "cached", "repeat", "session", "seeded"):
        assert two[key] == one[key], key
    assert two_alone == one_alone


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tp2_quantized_engine_serves_tp1s_tokens(paths, method):
    """`--quantization` under tensor parallelism, through the radix cache, chunked prefill, a
    session and sampling: the pools come back whole, the shared prefix comes from the cache, an
    exact repeat is served whole, and the greedy tokens are tp=1's up to the int8 rounding of
    the activations, where a last-bit difference of the split sums can flip a rounding (at
    least 80% equal, the first token of every request equal)."""
    opts = {"mamba_scheduler_strategy": "extra_buffer", "quantization": method, **POOLS}
    tp2 = Engine(paths["mixed"], tp_size=2, **opts)
    try:
        two = _workload(tp2)
    finally:
        tp2.shutdown()
    one = _workload(Engine(paths["mixed"], **opts))
    assert two["leaks"] == [] and one["leaks"] == []
    assert min(two["cached"]) >= 64 and two["repeat"][1] == 145
    pairs = [
        (a, b)
        for key in ("round1", "round2", "session")
        for a, b in zip(two[key], one[key], strict=True)
    ]
    assert all(a[0] == b[0] for a, b in pairs)
    same = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
    assert same >= 0.8 * sum(len(b) for _, b in pairs), pairs
