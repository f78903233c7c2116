"""A fault raised for one request fails that request and nothing else: the others finish with the
tokens a fault-free run gives, everything is freed, and the scheduler keeps serving; a fault that
leaves the pools not adding up raises PoolsCorrupt. Faults come from the test switch
($HYBRID_SERVE_TEST_FAULT) or a patched runner."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.debug import FAULT_ENV, DebugSwitches
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.faults import PoolsCorrupt
from hybrid_serve.scheduler.loop import SchedulerLoop
from hybrid_serve.scheduler.loop_io import InProcessIO
from hybrid_serve.scheduler.messages import GenerateMsg
from hybrid_serve.scheduler.request import FinishReason, Req
from hybrid_serve.scheduler.sampling_params import SamplingParams

OPTIONS = {
    "max_running_requests": 8,
    "max_total_tokens": 4096,
    "chunked_prefill_size": 16,
    "disable_cuda_graph": True,
}
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=11))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 20, 37, 9)]
    expected = [o["output_ids"] for o in Engine(path, **OPTIONS).generate(prompts, GREEDY)]
    return path, prompts, expected


def run(engine: Engine, prompts: list[list[int]], rids: list[str], act=None) -> list[Req]:
    """Drive the scheduler directly (rids chosen here); act(step_index) may abort or stop."""
    sched = engine.scheduler
    reqs = [Req(rid, p, SamplingParams(**GREEDY)) for rid, p in zip(rids, prompts, strict=True)]
    for req in reqs:
        sched.add_request(req)
    for i in range(500):
        if not sched.has_work():
            break
        if act is not None:
            act(i)
        sched.step()
    assert all(r.finished for r in reqs)
    return reqs


def check_rest(reqs: list[Req], expected: list[list[int]], failed: set[str]) -> None:
    for req, exp in zip(reqs, expected, strict=True):
        if req.rid in failed:
            assert req.error and req.rid in req.error and "injected" in req.error
            assert req.finish_reason == FinishReason.ABORT
        else:
            assert req.error is None and req.output_ids == exp, req.rid


@pytest.mark.parametrize("spec", ["step:bad", "step:bad@4"])  # in its prefill, in a decode step
def test_step_fault_fails_only_that_request(setup, monkeypatch, spec):
    path, prompts, expected = setup
    monkeypatch.setenv(FAULT_ENV, spec)
    engine = Engine(path, **OPTIONS)
    reqs = run(engine, prompts, ["a", "bad-1", "b", "c"])
    check_rest(reqs, expected, {"bad-1"})
    assert engine.scheduler.aborts == {"error": 1}
    if "@" in spec:
        assert len(reqs[1].output_ids) == 4  # tokens before the fault were delivered
    assert engine.leak_report() == []
    again = engine.generate(prompts, GREEDY)  # still serving, and the cache did not go wrong
    assert [o["output_ids"] for o in again] == expected
    assert engine.leak_report() == []


def test_abort_and_stop_faults_fail_that_request(setup, monkeypatch):
    path, prompts, expected = setup
    monkeypatch.setenv(FAULT_ENV, "abort:bad")
    engine = Engine(path, **OPTIONS)
    sched = engine.scheduler

    def act(i: int) -> None:
        if i == 3:
            sched.abort("bad-abort")
        if i == 5:
            sched.stop("bad-stop", 1)

    reqs = run(engine, prompts, ["a", "bad-abort", "bad-stop", "b"], act)
    check_rest(reqs, expected, {"bad-abort", "bad-stop"})
    assert sched.aborts == {"error": 2}
    assert engine.leak_report() == []


def test_forward_fault_fails_the_batch_and_frees_its_kv(setup):
    """A fault that cannot be pinned on one request (the forward) fails the batch in flight,
    KV drawn for that step included; the next requests run normally."""
    path, prompts, expected = setup
    engine = Engine(path, **OPTIONS)
    runner, calls = engine.runner, []
    real = runner.forward

    def flaky(batch):
        calls.append(batch.phase)
        if len(calls) == 6:
            raise RuntimeError("device fell over")
        return real(batch)

    runner.forward = flaky
    sched = engine.scheduler
    reqs = [Req(f"r{i}", p, SamplingParams(**GREEDY)) for i, p in enumerate(prompts)]
    for req in reqs:
        sched.add_request(req)
    while sched.has_work():
        sched.step()
    failed = [r for r in reqs if r.error]
    assert failed and all("device fell over" in r.error for r in failed)
    assert engine.leak_report() == []
    runner.forward = real
    assert [o["output_ids"] for o in engine.generate(prompts, GREEDY)] == expected


def test_fault_that_leaks_stops_the_scheduler(setup, monkeypatch):
    path, prompts, _ = setup
    monkeypatch.setenv(FAULT_ENV, "leak:bad")
    engine = Engine(path, **OPTIONS)
    with pytest.raises(PoolsCorrupt, match="Mamba slots leaked"):
        run(engine, prompts[:2], ["a", "bad"])


def test_switch_syntax(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert DebugSwitches.from_env().faults == ()  # unset: no faults
    monkeypatch.setenv(FAULT_ENV, "step:a@3, abort:b")
    assert DebugSwitches.from_env().faults == (("step", "a", 3), ("abort", "b", 0))
    for bad in ("explode:x", "step:", "step:x@y"):
        monkeypatch.setenv(FAULT_ENV, bad)
        with pytest.raises(ValueError, match=FAULT_ENV):
            DebugSwitches.from_env()


def test_loop_refuses_a_bad_seed_and_keeps_serving(setup):
    """The issue's crash: make_generator raising for one request must not end the loop."""
    path, prompts, expected = setup
    engine = Engine(path, **OPTIONS)
    io = InProcessIO()
    loop = SchedulerLoop(engine.scheduler, io)
    bad = SamplingParams(**GREEDY)
    bad.seed = 2**64  # past validation, as a client bug upstream could send it
    io.put(GenerateMsg("bad", prompts[0], bad))
    io.put(GenerateMsg("good", prompts[0], SamplingParams(**GREEDY)))
    assert loop.run_once()
    refused, *deltas = io.take_deltas()
    assert refused.rid == "bad" and "seed" in refused.error and refused.error_status == 400
    while engine.scheduler.has_work():
        assert loop.run_once()
        deltas += io.take_deltas()
    assert all(d.rid == "good" and d.error is None for d in deltas)
    assert [t for d in deltas for t in d.output_ids] == expected[0]
    assert deltas[-1].finish_reason == "length"
    assert engine.leak_report() == []
