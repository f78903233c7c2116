"""What each tensor-parallel rank runs in the tests (spawned by `tests.tp_harness.run_ranks`;
kept apart from the test modules so a rank imports torch and our packages only)."""

from __future__ import annotations

import torch

from hybrid_serve.models.loader import load_model
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from tests.ragged_prefill import admit, ragged_prefill


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def model_outputs(
    tp: ParallelContext,
    path: str,
    prompts: list[list[int]],
    decode_steps: int,
    chunk: int,
    quantization: str | None = None,
) -> dict:
    """One-shot prefill logits of every prompt, the same prompts prefilled `chunk` tokens a
    round, then greedy decode of the whole batch (padded to 8): logits and tokens."""
    model = load_model(path, dtype="float32", tp=tp, quantization=quantization)
    runner = ModelRunner(model, RunnerConfig(max_running_requests=12, max_total_tokens=4096))
    out: dict = {"param_bytes": param_bytes(model)}
    n = len(prompts)

    def prefill(step: int | None) -> tuple[list[tuple[int, int]], torch.Tensor]:
        slots = admit(runner, n)
        return slots, ragged_prefill(runner, prompts, slots, step)

    _, out["chunked"] = prefill(chunk)
    slots, out["prefill"] = prefill(None)
    tokens = out["prefill"].argmax(-1).tolist()
    seq_lens = [len(p) for p in prompts]
    out["tokens"], out["decode"] = [tokens], []
    for _ in range(decode_steps):
        items = [DecodeInput(r, m, seq_lens[i], tokens[i]) for i, (r, m) in enumerate(slots)]
        locs = torch.cat([runner.alloc_kv(r, seq_lens[i], 1) for i, (r, _) in enumerate(slots)])
        logits = runner.forward(runner.build_decode(items, locs, pad_to=8))[:n]
        tokens = logits.argmax(-1).tolist()
        seq_lens = [s + 1 for s in seq_lens]
        out["decode"].append(logits)
        out["tokens"].append(tokens)
    out["decode"] = torch.stack(out["decode"])
    out["rank_param_bytes"] = _gather_bytes(tp, out["param_bytes"])
    return out


def each_model_outputs(
    tp: ParallelContext, jobs: list[tuple], decode_steps: int, chunk: int
) -> list[dict]:
    """`model_outputs` for each (checkpoint, prompts[, quantization]) in turn."""
    return [model_outputs(tp, job[0], job[1], decode_steps, chunk, *job[2:]) for job in jobs]


def _gather_bytes(tp: ParallelContext, n: int) -> list[int]:
    if not tp.enabled:
        return [n]
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.size)]
    torch.distributed.all_gather(parts, torch.tensor([n]))
    return [int(p) for p in parts]


def config_mismatch(tp: ParallelContext) -> str:
    """Rank 1 starts with another KV pool size: the message rank 0 gets."""
    from hybrid_serve.scheduler.config import SchedulerConfig
    from hybrid_serve.scheduler.lockstep import check_same_config

    cfg = RunnerConfig(max_total_tokens=1024 * (1 + tp.rank), num_threads=1 + tp.rank)
    try:
        check_same_config(tp, cfg, SchedulerConfig())
    except ValueError as e:
        return str(e)
    return "no error"


def lockstep_workload(tp: ParallelContext, path: str) -> dict | None:
    """Every rank's `SchedulerLoop` on rank 0's inputs (`scheduler.lockstep`): requests, an abort
    and a stop string mid-decode, a seeded sample, a session whose id rank 0 draws, whose held
    slot a query unknown to the lockstep layer frees, and which expires on rank 0's clock with a
    turn in flight, then a flush. Rank 0 gets every rank's state after each phase and the last
    deltas it sent."""
    from hybrid_serve.scheduler.build import build_scheduler
    from hybrid_serve.scheduler.config import SchedulerConfig
    from hybrid_serve.scheduler.leak_check import leak_report
    from hybrid_serve.scheduler.lockstep import Leader, NullIO, follow
    from hybrid_serve.scheduler.loop import SchedulerLoop
    from hybrid_serve.scheduler.loop_io import InProcessIO
    from hybrid_serve.scheduler.messages import AbortMsg, GenerateMsg, QueryMsg, ShutdownMsg
    from hybrid_serve.scheduler.sampling_params import SamplingParams

    def state(loop: SchedulerLoop) -> dict:
        s, r = loop.scheduler, loop.scheduler.runner
        return {
            "free": [r.kv_pool.available(), r.mamba_pool.available(), r.req_pool.available()],
            "cached": [s.tree.total_size(), s.tree.mamba_evictable_size()],
            "sessions": {sid: x.slot is not None for sid, x in s.sessions.sessions.items()},
            "aborts": dict(s.aborts),
            "leaks": leak_report(s),
        }

    # queries no rank was told about: the loop's inputs reach every rank, whatever they do
    SchedulerLoop._q_evict_sessions = lambda self: self.scheduler.sessions.evict_all()
    SchedulerLoop._q_state = lambda self: self.gather(state(self))
    runner_cfg = RunnerConfig(
        tp_size=2, dtype="float32", max_running_requests=4, max_total_tokens=1024, num_threads=1
    )
    sched_cfg = SchedulerConfig(chunked_prefill_size=64, mamba_scheduler_strategy="extra_buffer")
    sched = build_scheduler(path, runner_cfg, sched_cfg, tp)
    if not tp.is_first:
        follow(SchedulerLoop(sched, NullIO()), tp)
        return None
    io = InProcessIO()
    loop = SchedulerLoop(sched, io)
    Leader(loop, tp)
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    states, last = [], {}

    def send(*msgs, rounds: int | None = None) -> None:
        """Queue msgs and run `rounds` rounds (None: until idle)."""
        for msg in msgs:
            io.put(msg)
        for _ in range(rounds or 1000):
            loop.run_once()
            last.update({d.rid: (d.finish_reason, d.finish_detail) for d in io.take_deltas()})
            if rounds is None and not sched.has_work():
                break
        if rounds is None:
            states.append(loop.call(QueryMsg(0, "state")))

    def generate(rid: str, params: SamplingParams = greedy, session: dict | None = None):
        prompt = torch.randint(3, 2000, (70,), generator=gen).tolist()
        return GenerateMsg(rid, prompt, params, session)

    seeded = SamplingParams(max_new_tokens=6, temperature=0.9, seed=7)
    send(*(generate(rid) for rid in "abc"), generate("d", seeded), rounds=3)
    send(AbortMsg("a"), AbortMsg("b", keep_output_tokens=1))
    sid = loop.call(QueryMsg(0, "open_session", {"session_timeout": 60.0}))
    send(generate("t1", session={"id": sid}))
    loop.call(QueryMsg(0, "evict_sessions"))
    send()
    send(generate("t2", session={"id": sid, "rid": "t1"}))
    send(generate("t3", session={"id": sid, "rid": "t2"}), rounds=2)
    sched.sessions.sessions[sid].deadline, loop.next_reap = 0.0, 0.0  # rank 0's clock says so
    send()
    loop.call(QueryMsg(0, "flush"))
    send()
    io.put(ShutdownMsg())
    assert not loop.run_once()
    return {"states": states, "last": last, "sid": sid}


def mtp_outputs(
    tp: ParallelContext,
    path: str,
    lens: tuple[int, ...],
    seed: int,
    quantization: str | None = None,
    fp8_resident: bool | None = None,
) -> dict:
    """The MTP head's y (`mtp_hidden`) for an extend batch of requests of `lens` tokens and then
    one decode row for each, on seeded random token ids and hidden states (the same on every
    rank)."""
    model = load_model(
        path, dtype="float32", tp=tp, quantization=quantization, mtp=True, fp8_resident=fp8_resident
    )
    runner = ModelRunner(model, RunnerConfig(max_running_requests=4, max_total_tokens=64))
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    ids = [torch.randint(3, c.vocab_size, (n + 1,), generator=gen).tolist() for n in lens]
    hidden = [torch.randn(n + 1, c.hidden_size, generator=gen) for n in lens]
    slots = admit(runner, len(lens))
    requests = list(zip(slots, ids, hidden, lens, strict=True))
    items = [ExtendInput(r, m, 0, i[:n]) for (r, m), i, _, n in requests]
    locs = [runner.alloc_kv(r, 0, n) for (r, _), _, _, n in requests]
    h = torch.cat([h[:n] for _, _, h, n in requests])  # [T, hidden]
    extend = model.mtp_hidden(runner.build_prefill(items, locs), h)
    rows = [DecodeInput(r, m, n, i[n]) for (r, m), i, _, n in requests]
    loc = torch.cat([runner.alloc_kv(r, n, 1) for (r, _), _, _, n in requests])
    h = torch.stack([h[n] for _, _, h, n in requests])  # [N, hidden]
    decode = model.mtp_hidden(runner.build_decode(rows, loc), h)
    pool = runner.kv_pool
    return {
        "ids": ids,
        "hidden": hidden,
        "extend": extend,
        "decode": decode,
        "head_bytes": param_bytes(model.mtp),
        "kv_layers": pool.k_all.shape[0],
        # the head wrote its keys and values to its own pool layer, the last, and only there
        "kv_written": [
            bool(pool.k_all[i].any() or pool.v_all[i].any()) for i in range(pool.k_all.shape[0])
        ],
    }
