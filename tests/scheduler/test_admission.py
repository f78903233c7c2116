"""Admission under KV pressure (issue 13's livelock): with chunked prefill and a small KV pool,
a long prompt arriving while three streams hold KV must not freeze them. The streams keep
producing tokens (at most a few steps without one) while the long prompt waits or is chunked,
and every request finishes with the tokens an unpressured engine gives."""

from __future__ import annotations

import time

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.request import FinishReason, Req
from hybrid_serve.scheduler.sampling_params import SamplingParams

MAX_STEPS = 600
TIME_LIMIT_S = 120.0
MAX_STALL_STEPS = 8  # steps in a row without a token for any of the three streams


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=11))


def prompts() -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(13)
    streams = [torch.randint(3, 200, (40,), generator=gen).tolist() for _ in range(3)]
    return streams, torch.randint(3, 200, (900,), generator=gen).tolist()


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def drive(engine: Engine, stream_new: int, long_new: int) -> tuple[list[Req], Req, int]:
    """Three streams hold KV, then the long prompt arrives; step until all finish. Returns the
    streams, the long request and the longest run of steps in which no stream got a token."""
    sched = engine.scheduler
    stream_prompts, long_prompt = prompts()
    streams = [Req(f"s{i}", p, params(stream_new)) for i, p in enumerate(stream_prompts)]
    for req in streams:
        sched.add_request(req)
    for _ in range(5):  # they hold KV and decode
        sched.step()
    assert all(r.output_ids and not r.finished for r in streams)
    long = Req("long", long_prompt, params(long_new))
    sched.add_request(long)
    stall = longest = steps = 0
    deadline = time.monotonic() + TIME_LIMIT_S
    while sched.has_work():
        assert steps < MAX_STEPS and time.monotonic() < deadline, "livelock: not drained"
        before = sum(len(r.output_ids) for r in streams)
        sched.step()
        steps += 1
        moved = sum(len(r.output_ids) for r in streams) > before
        alive = any(not r.finished for r in streams)
        stall = 0 if moved or not alive else stall + 1
        longest = max(longest, stall)
    return streams, long, longest


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "radix-off"])
def test_long_prompt_does_not_freeze_running_streams(model_path, radix):
    options = {
        "max_running_requests": 4,
        "max_total_tokens": 1024,
        "max_context_len": 1024,
        "chunked_prefill_size": 64,
        "disable_radix_cache": not radix,
        "disable_cuda_graph": True,
    }
    engine = Engine(model_path, **options)
    streams, long, longest_stall = drive(engine, stream_new=200, long_new=16)
    assert longest_stall <= MAX_STALL_STEPS, f"streams froze for {longest_stall} steps"
    for req in [*streams, long]:
        assert req.finish_reason == FinishReason.LENGTH, (req.rid, req.finish_detail)
    assert engine.leak_report() == []
    # the same tokens as with room to spare
    roomy = Engine(model_path, **{**options, "max_total_tokens": 4096})
    expected = roomy.generate(
        [r.prompt_ids for r in [*streams, long]],
        [
            {"max_new_tokens": r.params.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
            for r in [*streams, long]
        ],
    )
    assert [r.output_ids for r in [*streams, long]] == [o["output_ids"] for o in expected]


def roomy(model_path: str) -> Engine:
    return Engine(
        model_path,
        max_running_requests=4,
        max_total_tokens=2048,
        chunked_prefill_size=64,
        disable_cuda_graph=True,
    )


def start_streams_and_long(engine: Engine, long_len: int = 300) -> tuple[list[Req], Req]:
    """Three decoding streams, then a long prompt that has prefilled its first chunk."""
    sched = engine.scheduler
    stream_prompts, long_prompt = prompts()
    streams = [Req(f"s{i}", p, params(30)) for i, p in enumerate(stream_prompts)]
    for req in streams:
        sched.add_request(req)
    for _ in range(3):
        sched.step()
    long = Req("long", long_prompt[:long_len], params(8))
    sched.add_request(long)
    sched.step()
    assert sched.chunked is long and long.kv_len == 64
    return streams, long


def finish_and_check(engine: Engine, model_path: str, reqs: list[Req]) -> None:
    while engine.scheduler.has_work():
        engine.scheduler.step()
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert engine.leak_report() == []
    spec = [
        {"max_new_tokens": r.params.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        for r in reqs
    ]
    expected = roomy(model_path).generate([r.prompt_ids for r in reqs], spec)
    assert [r.output_ids for r in reqs] == [o["output_ids"] for o in expected]


def test_chunk_short_of_kv_holds_while_the_streams_decode(model_path, monkeypatch):
    engine = roomy(model_path)
    sched, runner = engine.scheduler, engine.runner
    streams, long = start_streams_and_long(engine)
    real = runner.alloc_kv
    monkeypatch.setattr(
        runner, "alloc_kv", lambda s, p, n: None if s == long.req_slot else real(s, p, n)
    )
    for _ in range(3):
        before = [len(r.output_ids) for r in streams]
        sched.step()
        assert [len(r.output_ids) for r in streams] == [n + 1 for n in before]  # decoded
        assert sched.chunked is long and long.kv_len == 64 and long.req_slot is not None
    monkeypatch.setattr(runner, "alloc_kv", real)
    finish_and_check(engine, model_path, [*streams, long])


def test_decode_short_of_kv_retracts_the_chunked_request_first(model_path, monkeypatch):
    engine = roomy(model_path)
    sched, runner = engine.scheduler, engine.runner
    streams, long = start_streams_and_long(engine)
    real_kv, real_decode = runner.alloc_kv, runner.alloc_decode_kv
    monkeypatch.setattr(  # the next chunk does not fit, so the streams decode ...
        runner, "alloc_kv", lambda s, p, n: None if s == long.req_slot else real_kv(s, p, n)
    )

    def decode_short(slots, positions):  # ... and decode is short while the long one holds KV
        return None if long.req_slot is not None else real_decode(slots, positions)

    monkeypatch.setattr(runner, "alloc_decode_kv", decode_short)
    before = [len(r.output_ids) for r in streams]
    sched.step()
    assert sched.chunked is None and long in sched.waiting and long.req_slot is None
    assert sched.retractions == 1
    assert [len(r.output_ids) for r in streams] == [n + 1 for n in before]
    assert all(r in sched.running for r in streams)
    monkeypatch.setattr(runner, "alloc_kv", real_kv)
    finish_and_check(engine, model_path, [*streams, long])


def test_new_token_ratio_follows_sglang():
    from hybrid_serve.scheduler.schedule_policy import NewTokenRatio

    ratio = NewTokenRatio(1.0)
    assert (ratio.init, ratio.value) == (0.7, 0.7)
    assert ratio.min == pytest.approx(0.7 * 0.14)
    for _ in range(300):
        ratio.decay()
    assert ratio.value == pytest.approx((0.7 + 0.098) / 2)
    for _ in range(400):
        ratio.decay()
    assert ratio.value == pytest.approx(0.098)
    kept = [Req("a", [1], params(100)), Req("b", [1], params(100))]
    kept[0].output_ids = [5] * 30
    ratio.after_retract(kept)
    assert ratio.value == pytest.approx((30 + 2 * 20) / 201)
    ratio.reset()
    assert ratio.value == 0.7
    assert NewTokenRatio(2.0).init == 1.0


def test_reservation_scales_with_conservativeness(model_path):
    """A long prompt arriving beside the streams starts at once when little is reserved for
    them, and waits for them when much is."""
    started = {}
    for c in (0.01, 1.0):
        engine = Engine(
            model_path,
            max_running_requests=4,
            max_total_tokens=900,
            chunked_prefill_size=64,
            schedule_conservativeness=c,
            disable_cuda_graph=True,
        )
        sched = engine.scheduler
        stream_prompts, long_prompt = prompts()
        for i, p in enumerate(stream_prompts):
            sched.add_request(Req(f"s{i}", p, params(200)))
        while len(sched.running) < 3:
            sched.step()
        long = Req("long", long_prompt[:400], params(8))
        sched.add_request(long)
        sched.step()
        started[c] = long.kv_len > 0
    assert started == {0.01: True, 1.0: False}


def test_prompt_larger_than_the_kv_cache_is_refused(model_path):
    engine = Engine(model_path, max_total_tokens=256, max_context_len=1024)
    with pytest.raises(ValueError, match="KV cache holds 256"):
        engine.scheduler.add_request(Req("big", list(range(3, 303)), params(4)))
    assert not engine.scheduler.has_work()


def test_mamba_slot_draws_evict_idle_sessions(model_path):
    """Every Mamba slot draw (not only admission's) frees an idle session's held slot when the
    pool and the tree have none left."""
    engine = Engine(model_path, max_running_requests=4, mamba_cache_size=4)
    sid = engine.open_session(capacity_of_str_len=500)
    engine.generate(list(range(3, 40)), {"max_new_tokens": 4}, session_params={"id": sid})
    session = engine.scheduler.sessions.sessions[sid]
    assert session.slot is not None
    cache, taken = engine.scheduler.cache, []
    while (slot := cache.alloc_slot()) is not None:
        taken.append(slot)
        if session.slot is None:
            break
    assert session.slot is None, "the idle session's slot was never evicted"
    cache.pool.free(taken)
    assert engine.leak_report() == []
