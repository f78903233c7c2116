"""Prefill snapshots land on the sequence's 64-token grid (positions p with p % 64 == 0 counted
from the sequence's start), whatever the prefill chunk size and wherever a round starts, in every
Mamba strategy, on a Gated DeltaNet family (the tiny Qwen3-Next preset), a Mamba2 family
(tiny-nemotron-h) and a short-conv family (tiny-lfm2).

For chunks of 37, 40, 63, 96 and 100 tokens and none (with 63, a snapshot 1, 2, 3... tokens into
a round: conv windows that reach back before the round): a shared 512-token prefix is reused for at
least 448 tokens; every snapshot the scheduler asks for, and every state the radix tree holds
that is not the end of a prompt, of a prefill round (no_buffer) or of a finished request, lies on
the grid; greedy tokens equal transformers' (the uncached run); the leak checker is clean. A
session turn that ends off the grid is continued by a turn whose snapshots are on the grid too.
Before the grid, a strategy snapshotting 64-token multiples counted from a round's start left
none with chunks under 64 tokens and put them off the grid (160, 224, ...) with chunks of 96."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from tests.hf_reference import GreedyJudge

GRID = 64
NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
SHARED = 512
STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]
CHUNKS = [None, 37, 40, 63, 96, 100]  # 63: rounds start 1, 2, 3... tokens before grid points


@pytest.fixture(scope="module", params=["tiny", "tiny-nemotron-h", "tiny-lfm2"])
def case(request, tmp_path_factory):
    preset = request.param
    config = preset_config(preset)
    path = write_checkpoint(tmp_path_factory.mktemp(preset), config, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(17)

    def rand(n: int) -> list[int]:
        return torch.randint(3, config["vocab_size"], (n,), generator=gen).tolist()

    shared = rand(SHARED)
    prompts = [shared + rand(40), shared + rand(30)]
    # each strategy and chunk size serves the same session and branches: transformers once
    judge = GreedyJudge(hf, NEW)
    session = {"turns": [rand(100), rand(450)], "other": rand(20)}
    branches = {"first": rand(300), "tail": rand(30)}
    return str(path), judge, (session, branches), prompts, judge(prompts)


def engine_recording_snapshots(path: str, **options) -> tuple[Engine, list[int]]:
    """An engine, and the list into which each prefill snapshot's length (the tokens before the
    tracked state) goes as the scheduler asks the model for it."""
    engine = Engine(path, max_running_requests=4, max_total_tokens=4096, **options)
    cache, lengths = engine.scheduler.cache, []
    ask = cache.prefill_track

    def recording(req, extend_len):
        offset, slot = ask(req, extend_len)
        if offset:
            lengths.append(req.kv_len + offset)
        return offset, slot

    cache.prefill_track = recording
    return engine, lengths


def state_depths(engine: Engine) -> set[int]:
    """The token count before each state the radix tree holds."""
    depths, out = {}, set()
    for node in engine.scheduler.tree.iter_nodes():  # parents before children
        depth = depths[node.id] = depths.get(node.parent.id, 0) + len(node.key)
        if node.has_state:
            out.add(depth)
    return out


def off_grid(lengths: set[int] | list[int]) -> list[int]:
    return sorted(n for n in lengths if n % GRID)


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"chunk-{c}" if c else "one-shot")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_snapshots_on_the_grid(case, strategy, chunk):
    path, _, _, prompts, expected = case
    options = {"chunked_prefill_size": chunk} if chunk else {}
    engine, snapshots = engine_recording_snapshots(
        path, mamba_scheduler_strategy=strategy, **options
    )
    ends: set[int] = set()  # states kept at a prompt's, a round's or a request's end
    for i, prompt in enumerate(prompts):
        out = engine.generate(prompt, GREEDY)
        assert out["output_ids"] == expected[i], f"request {i}"
        cached = out["meta_info"]["cached_tokens"]
        if i:
            assert cached >= SHARED - GRID, (strategy, chunk, cached, sorted(snapshots))
        ends |= {len(prompt), len(prompt) + NEW - 1}
        if strategy == "no_buffer" and chunk:
            ends |= set(range(cached + chunk, len(prompt), chunk))
        assert snapshots and not off_grid(snapshots), sorted(snapshots)
        assert not off_grid(state_depths(engine) - ends), sorted(state_depths(engine))
    assert engine.leak_report() == []
    assert engine.scheduler.tree.sanity_check() is None


@pytest.mark.parametrize("chunk", [None, 37, 100], ids=lambda c: f"chunk-{c}" if c else "one-shot")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_session_turn_continued_off_the_grid(case, strategy, chunk):
    """Turn 1 (100 tokens, 6 out) ends at 105 cached tokens, off the grid; turn 2 continues it
    with 450 tokens: its rounds start at 105 and its snapshots land at multiples of 64. A request
    without the session sharing the first 530 tokens of turn 2's context reuses at least 448.
    Each output equals transformers' on the whole conversation."""
    path, judge, (session, _), _, _ = case
    options = {"chunked_prefill_size": chunk} if chunk else {}
    engine, snapshots = engine_recording_snapshots(
        path, mamba_scheduler_strategy=strategy, **options
    )
    sid = engine.open_session(capacity_of_str_len=2000)
    context: list[int] = []
    rid = None
    for i, new in enumerate(session["turns"]):
        out = engine.generate(new, GREEDY, session_params={"id": sid, "rid": rid})
        expected = judge([context + new])[0]
        assert out["output_ids"] == expected, f"turn {i + 1}"
        if i:
            assert out["meta_info"]["cached_tokens"] == len(context) - 1 == 105
        context += new + expected
        rid = out["meta_info"]["id"]
    assert max(snapshots) >= 512 and not off_grid(snapshots), sorted(snapshots)
    assert engine.close_session(sid)
    other = context[:530] + session["other"]
    res = engine.generate(other, GREEDY)
    assert res["output_ids"] == judge([other])[0]
    assert res["meta_info"]["cached_tokens"] >= SHARED - GRID
    assert not off_grid(snapshots), sorted(snapshots)
    assert engine.leak_report() == []
    assert engine.scheduler.tree.sanity_check() is None


@pytest.mark.parametrize("shared", [100, 150])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_snapshot_a_token_or_two_into_a_round_is_reused_exactly(case, strategy, shared):
    """Chunks of 63: the rounds [63, 126) and [126, 189) snapshot at 64 and 128, one and two
    tokens in, so the conv windows there reach back into the window the request's slot held
    before the round. A request that shares 100 (150) tokens resumes from the state at 64 (128)
    and equals transformers."""
    path, judge, (_, branches), _, _ = case
    engine, snapshots = engine_recording_snapshots(
        path, mamba_scheduler_strategy=strategy, chunked_prefill_size=63
    )
    first = branches["first"]
    branch = first[:shared] + branches["tail"]
    expected = judge([first, branch])
    assert engine.generate(first, GREEDY)["output_ids"] == expected[0]
    assert {64, 128} <= set(snapshots)
    out = engine.generate(branch, GREEDY)
    assert out["meta_info"]["cached_tokens"] == shared // GRID * GRID
    assert out["output_ids"] == expected[1]
    assert engine.leak_report() == []


@pytest.mark.parametrize("case", ["tiny"], indirect=True)
@pytest.mark.parametrize("chunk", [37, 100])
def test_gdn_chunked_reference_snapshots_on_the_grid(case, kernels_mode, chunk):
    """The shared prefix with the pure-torch kernels: the chunked reference runs a tracked
    round's leading piece of offset % 64 tokens on its own (the default CPU kernels step token by
    token; the Triton kernel's masked leading rows: tests/kernels/test_triton_kernels.py)."""
    path, _, _, prompts, expected = case
    kernels_mode("torch")
    engine, snapshots = engine_recording_snapshots(
        path, mamba_scheduler_strategy="extra_buffer", chunked_prefill_size=chunk
    )
    ops = {m.ops.backend for m in engine.scheduler.runner.model.modules() if hasattr(m, "ops")}
    assert ops == {"torch"}
    assert engine.generate(prompts[0], GREEDY)["output_ids"] == expected[0]
    out = engine.generate(prompts[1], GREEDY)
    assert out["output_ids"] == expected[1]
    assert out["meta_info"]["cached_tokens"] >= SHARED - GRID
    assert snapshots and not off_grid(snapshots), sorted(snapshots)
    assert engine.leak_report() == []
