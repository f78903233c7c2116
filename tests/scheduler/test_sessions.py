"""Sessions end to end (tree sessions with explicit parents, streaming ones continuing the
latest turn): multi-turn parity with one request on the concatenated input,
only new tokens prefilled, ownership of the held slot (restore, not-admitted, abort, close,
branching), errors, and the leak checker with session-held resources."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.session import SessionError
from tests.hf_reference import hf_greedy
from tests.scheduler.helpers import make_req, reap_sessions

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
POOLS = {"max_running_requests": 4, "max_total_tokens": 2048}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=21)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    vocab = preset_config("tiny")["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    return str(path), hf, rand


MODES = {
    "no-buffer": {},
    "extra-buffer": {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 4},
    "lazy": {"mamba_scheduler_strategy": "extra_buffer_lazy", "mamba_track_interval": 4},
    "radix-off": {"disable_radix_cache": True},
    "chunk-16": {"chunked_prefill_size": 16},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_three_turns_equal_one_request_and_prefill_only_new_tokens(ckpt, mode):
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS, **MODES[mode])
    sid = engine.open_session(capacity_of_str_len=1000)
    turns = [rand(70), rand(9), rand(30)]
    context: list[int] = []
    rid = None
    for i, new in enumerate(turns):
        out = engine.generate(new, GREEDY, session_params={"id": sid, "rid": rid})
        expected = hf_greedy(hf, [context + new], NEW)[0]
        assert out["output_ids"] == expected, f"turn {i + 1}"
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(context) + len(new)
        if i:  # everything but the previous turn's last sampled token was held
            assert meta["cached_tokens"] == len(context) - 1
        context += new + expected
        rid = meta["id"]
        assert engine.leak_report() == []  # session-held resources are accounted for
        # other traffic in between does not disturb the held state
        engine.generate(rand(20), GREEDY)
    assert engine.scheduler.sessions.sessions[sid].slot is not None
    assert engine.flush_cache()  # the held slot is a cache: flushed too, the session stays
    assert engine.scheduler.sessions.sessions[sid].slot is None
    assert engine.leak_report() == []
    assert engine.close_session(sid)
    assert not engine.close_session(sid)
    assert engine.leak_report() == []
    r = engine.runner
    assert r.kv_pool.available() == r.kv_pool.size
    assert r.mamba_pool.available() == r.mamba_pool.size
    assert r.req_pool.available() == r.req_pool.size


def test_session_errors(ckpt):
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS)
    with pytest.raises(SessionError, match="not found") as err:
        engine.generate(rand(5), GREEDY, session_params={"id": "nope"})
    assert err.value.status == 404
    sid = engine.open_session("s1", capacity_of_str_len=40, streaming=True)
    with pytest.raises(SessionError, match="already open"):
        engine.open_session("s1")
    first = engine.generate(rand(10), GREEDY, session_params={"id": sid})
    with pytest.raises(SessionError, match="not a turn"):
        engine.generate(rand(5), GREEDY, session_params={"id": sid, "rid": "req-x"})
    with pytest.raises(SessionError, match="outside the context"):
        engine.generate(rand(5), GREEDY, session_params={"id": sid, "offset": 99})
    with pytest.raises(SessionError, match="capacity"):
        engine.generate(rand(30), GREEDY, session_params={"id": sid})
    # one request in flight at a time
    req = make_req(engine, rand(3), GREEDY, {"id": sid, "rid": first["meta_info"]["id"]})
    engine.scheduler.add_request(req)
    with pytest.raises(SessionError, match="in flight"):
        engine.scheduler.add_request(make_req(engine, rand(3), GREEDY, {"id": sid}))
    engine.scheduler.step()  # prefill: the held slot is now the request's
    assert engine.close_session(sid)  # aborts the turn in flight, frees everything once
    assert req.finish_reason.value == "abort"
    assert engine.leak_report() == []
    assert engine.flush_cache()
    assert engine.runner.mamba_pool.available() == engine.runner.mamba_pool.size


def test_turn_not_admitted_leaves_the_slot_with_the_session(ckpt):
    """A restored turn that does not get in gives nothing back (the slot stays the session's)
    and restores again later: no double free (SGLang #23327)."""
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS)
    sched = engine.scheduler
    sid = engine.open_session(streaming=True)
    p1 = rand(12)
    o1 = engine.generate(p1, GREEDY, session_params={"id": sid})["output_ids"]
    slot = sched.sessions.sessions[sid].slot
    free = (engine.runner.kv_pool.available(), engine.runner.mamba_pool.available())
    p2 = rand(6)
    req = make_req(engine, p2, GREEDY, {"id": sid})
    sched.add_request(req)
    assert sched.sessions.restore(req) and req.req_slot == slot.req_slot
    sched._release(req, insert=False)  # what admission does when the turn does not fit
    assert req.req_slot is None and sched.sessions.sessions[sid].slot is slot
    assert (engine.runner.kv_pool.available(), engine.runner.mamba_pool.available()) == free
    while not req.finished:
        sched.step()
    assert req.cached_len == len(p1) + NEW - 1
    assert req.output_ids == hf_greedy(hf, [p1 + o1 + p2], NEW)[0]
    engine.close_session(sid)
    assert engine.leak_report() == []


def test_abort_mid_turn_then_continue_through_the_radix_cache(ckpt):
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS)
    sched = engine.scheduler
    sid = engine.open_session(streaming=True)
    p1 = rand(20)
    out1 = engine.generate(p1, GREEDY, session_params={"id": sid})
    req = make_req(engine, rand(4), GREEDY, {"id": sid, "rid": out1["meta_info"]["id"]})
    sched.add_request(req)
    sched.step()
    sched.step()
    assert sched.abort(req.rid) is req
    assert engine.leak_report() == []
    # the aborted turn is not part of the context; the session has no slot: radix path
    p3 = rand(5)
    out3 = engine.generate(p3, GREEDY, session_params={"id": sid})
    full = p1 + out1["output_ids"] + p3
    assert out3["output_ids"] == hf_greedy(hf, [full], NEW)[0]
    assert out3["meta_info"]["cached_tokens"] == len(p1)  # the first turn's prompt state
    engine.close_session(sid)
    assert engine.leak_report() == []


def test_replace_branches_from_an_earlier_turn(ckpt):
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS)
    sid = engine.open_session(streaming=True)
    p1, p2, p3 = rand(15), rand(6), rand(7)
    t1 = engine.generate(p1, GREEDY, session_params={"id": sid})
    t2 = engine.generate(p2, GREEDY, session_params={"id": sid})
    with pytest.raises(SessionError, match="not the latest"):
        engine.generate(p3, GREEDY, session_params={"id": sid, "rid": t1["meta_info"]["id"]})
    branch = engine.generate(
        p3, GREEDY, session_params={"id": sid, "rid": t1["meta_info"]["id"], "replace": True}
    )
    base = p1 + t1["output_ids"]
    assert branch["output_ids"] == hf_greedy(hf, [base + p3], NEW)[0]
    with pytest.raises(SessionError, match="not a turn"):  # forgotten by replace
        engine.generate(p3, GREEDY, session_params={"id": sid, "rid": t2["meta_info"]["id"]})
    # offset: splice into the branch's context, keeping only its first 10 tokens
    spliced = engine.generate(p2, GREEDY, session_params={"id": sid, "offset": 10})
    assert spliced["output_ids"] == hf_greedy(hf, [p1[:10] + p2], NEW)[0]
    engine.close_session(sid)
    assert engine.leak_report() == []


def test_refused_turns_leave_the_session_unchanged(ckpt):
    path, hf, rand = ckpt
    engine = Engine(path, max_context_len=64, **POOLS)
    sid = engine.open_session(streaming=True)
    p1 = rand(20)
    t1 = engine.generate(p1, GREEDY, session_params={"id": sid})
    session = engine.scheduler.sessions.sessions[sid]
    slot = session.slot
    with pytest.raises(SessionError, match="context is 64"):  # too long: nothing changes
        engine.generate(rand(40), GREEDY, session_params={"id": sid, "rid": None})
    with pytest.raises(SessionError, match="already a turn"):  # a rid used twice
        req = make_req(engine, rand(3), GREEDY, {"id": sid})
        req.rid = t1["meta_info"]["id"]
        engine.scheduler.add_request(req)
    assert session.slot is slot and not session.in_flight and len(session.order) == 1
    p2 = rand(4)
    out = engine.generate(p2, GREEDY, session_params={"id": sid})
    assert out["output_ids"] == hf_greedy(hf, [p1 + t1["output_ids"] + p2], NEW)[0]
    engine.close_session(sid)
    assert engine.leak_report() == []


def test_stop_finishes_a_session_turn_with_the_kept_tokens(ckpt):
    """Scheduler.stop (a stop string matched by the API layer): the turn is recorded with the
    kept tokens only, and the next turn is exact on that context; after the fact, trim_turn."""
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS)
    sched = engine.scheduler
    sid = engine.open_session(streaming=True)
    p1 = rand(10)
    req = make_req(engine, p1, GREEDY, {"id": sid})
    sched.add_request(req)
    while len(req.output_ids) < 5:
        sched.step()
    assert sched.stop(req.rid, 3) is req
    assert req.finish_reason.value == "stop" and len(req.output_ids) == 3
    assert engine.leak_report() == []
    p2 = rand(4)
    out = engine.generate(p2, GREEDY, session_params={"id": sid})
    assert out["output_ids"] == hf_greedy(hf, [p1 + req.output_ids + p2], NEW)[0]
    # the stop string only showed up after the turn had finished: trim its recorded context
    assert sched.stop(out["meta_info"]["id"], 2) is None
    p3 = rand(3)
    out3 = engine.generate(p3, GREEDY, session_params={"id": sid})
    context = p1 + req.output_ids + p2 + out["output_ids"][:2] + p3
    assert out3["output_ids"] == hf_greedy(hf, [context], NEW)[0]
    engine.close_session(sid)
    assert engine.leak_report() == []


def test_idle_sessions_give_way_to_live_requests(ckpt):
    """Two idle sessions hold both request rows: a plain request evicts the least recently used
    one's slot and runs; that session's next turn goes through the radix cache, still exact."""
    path, hf, rand = ckpt
    engine = Engine(path, max_running_requests=2, max_total_tokens=2048)
    sids = [engine.open_session(streaming=True) for _ in range(2)]
    firsts = [rand(12), rand(15)]
    outs = [
        engine.generate(p, GREEDY, session_params={"id": s})
        for p, s in zip(firsts, sids, strict=True)
    ]
    assert engine.runner.req_pool.available() == 0
    plain = rand(9)
    assert engine.generate(plain, GREEDY)["output_ids"] == hf_greedy(hf, [plain], NEW)[0]
    sessions = engine.scheduler.sessions.sessions
    assert sessions[sids[0]].slot is None and sessions[sids[1]].slot is not None  # LRU went
    p2 = rand(5)
    again = engine.generate(p2, GREEDY, session_params={"id": sids[0]})
    context = firsts[0] + outs[0]["output_ids"] + p2
    assert again["output_ids"] == hf_greedy(hf, [context], NEW)[0]
    assert again["meta_info"]["cached_tokens"] == len(firsts[0])  # the radix path
    for s in sids:
        engine.close_session(s)
    assert engine.leak_report() == []


def test_tree_session_follows_sglang_rules(ckpt):
    """SGLang's non-streaming session: rid None is a fresh root, a parent's context is its
    prompt + output[:max_new_tokens] (only the prompt with drop_previous_output), cut as a
    Python slice at a non-zero offset; replace:false forks, replace:true forgets the parent's
    children (aborting a running one). Each turn equals one plain request on that context."""
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS)
    sched = engine.scheduler
    sid = engine.open_session()
    p1, p2, p3, p4 = rand(14), rand(5), rand(6), rand(4)

    def turn(new, rid=None, **kw):
        out = engine.generate(new, GREEDY, session_params={"id": sid, "rid": rid, **kw})
        return out["meta_info"]["id"], out["output_ids"], out["meta_info"]

    r1, o1, _ = turn(p1, offset=-1, replace=True)  # no parent: offset is ignored
    assert o1 == hf_greedy(hf, [p1], NEW)[0]
    r2, o2, m2 = turn(p2, r1, offset=-1, replace=True)  # linear, cut the last token
    ctx2 = (p1 + o1)[:-1] + p2
    assert o2 == hf_greedy(hf, [ctx2], NEW)[0] and m2["prompt_tokens"] == len(ctx2)
    assert m2["cached_tokens"] == len(p1) + NEW - 1  # the held slot: exactly where r1 ended
    r3, o3, _ = turn(p3, r1)  # fork beside r2 (offset 0: no cut)
    assert o3 == hf_greedy(hf, [p1 + o1 + p3], NEW)[0]
    _, o4, _ = turn(p4, r2, drop_previous_output=True, offset=-100)  # clamps to empty
    assert o4 == hf_greedy(hf, [p4], NEW)[0]
    _, o5, _ = turn(p4, r2, drop_previous_output=True)
    assert o5 == hf_greedy(hf, [ctx2 + p4], NEW)[0]
    fresh, o6, _ = turn(p3)  # rid None, replace false: a new root, nothing forgotten
    assert o6 == hf_greedy(hf, [p3], NEW)[0] and len(sched.sessions.sessions[sid].turns) == 6
    # replace on r1 forgets r2, r3 and their children; r1 and the fresh root stay
    r7, o7, _ = turn(p2, r1, replace=True, offset=5)
    assert o7 == hf_greedy(hf, [p1[:5] + p2], NEW)[0]
    assert set(sched.sessions.sessions[sid].turns) == {r1, fresh, r7}
    with pytest.raises(SessionError, match="Invalid request session id"):
        turn(p2, r2)
    # a running child is aborted when its parent is replaced; a running parent cannot fork
    running = make_req(engine, p2, GREEDY, {"id": sid, "rid": r7})
    sched.add_request(running)
    sched.step()
    with pytest.raises(SessionError, match="has not finished"):
        sched.add_request(make_req(engine, p3, GREEDY, {"id": sid, "rid": running.rid}))
    _, o8, _ = turn(p3, r7, replace=True)
    assert running.finish_reason.value == "abort"
    assert o8 == hf_greedy(hf, [p1[:5] + p2 + o7 + p3], NEW)[0]
    # replace with rid None clears the whole tree
    turn(p4, None, replace=True)
    assert len(sched.sessions.sessions[sid].turns) == 1
    assert engine.leak_report() == []
    engine.close_session(sid)
    assert engine.leak_report() == []


def test_sessions_time_out_and_are_capped(ckpt):
    """Issue 14: a session past its timeout is reaped like a close (held slot freed, the turn in
    flight aborted); `max_sessions` refuses one more with a 429; a new turn pushes the
    deadline."""
    path, _, rand = ckpt
    engine = Engine(path, max_sessions=2, session_timeout=100.0, **POOLS)
    sched = engine.scheduler
    held = engine.open_session()  # the server default timeout
    busy = engine.open_session(timeout=5.0)
    with pytest.raises(SessionError, match="max-sessions") as e:
        engine.open_session()
    assert e.value.status == 429
    with pytest.raises(SessionError, match="timeout"):
        sched.sessions.open("x", timeout=0.0)
    engine.generate(rand(12), GREEDY, session_params={"id": held})
    assert sched.sessions.sessions[held].slot is not None
    req = make_req(engine, rand(6), GREEDY, {"id": busy})
    sched.add_request(req)
    sched.step()
    now = sched.sessions.sessions[busy].deadline
    assert sched.sessions.next_deadline() == now
    assert reap_sessions(sched, now - 1.0) == []
    assert reap_sessions(sched, now) == [req]  # the in-flight turn is aborted with its session
    assert req.finished and "timed out" in req.finish_detail
    assert list(sched.sessions.sessions) == [held]
    engine.open_session()  # room again
    later = sched.sessions.sessions[held].deadline + 1.0
    assert reap_sessions(sched, later - 2.0) == []
    reap_sessions(sched, later)
    assert held not in sched.sessions.sessions  # its held slot went with it
    while sched.has_work():
        sched.step()
    sched.take_finished()
    assert engine.leak_report() == []
