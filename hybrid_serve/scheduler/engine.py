"""Offline `Engine`: the server's `SchedulerLoop` driven in-process, without sockets.

    engine = Engine(model_path="/tmp/tiny", chunked_prefill_size=64)
    outs = engine.generate(["Hello", [1, 2, 3]], {"max_new_tokens": 16, "temperature": 0})

Options are the fields of `RunnerConfig` and `SchedulerConfig` (SGLang's names). Each result is
a dict with `text`, `output_ids` and `meta_info`, folded from the loop's token deltas
(`scheduler/messages.py`) exactly as the API process receives them. Every call goes to the loop as
an input message (`SchedulerLoop.call`), so tensor-parallel ranks apply it too. Tests may drive
`engine.scheduler` directly (without tensor parallelism); the loop does not see those requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import asdict, fields
from functools import cached_property
from typing import Any

from hybrid_serve.scheduler.build import build_scheduler
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.cpu_env import configure_threads
from hybrid_serve.scheduler.lockstep import Leader
from hybrid_serve.scheduler.loop import SchedulerLoop
from hybrid_serve.scheduler.loop_io import InProcessIO
from hybrid_serve.scheduler.messages import AbortMsg, GenerateMsg, QueryMsg, RequestOutput
from hybrid_serve.scheduler.model_runner import RunnerConfig
from hybrid_serve.scheduler.request import SessionParams
from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.scheduler.tp_group import TPGroup, rank_threads

Prompt = str | list[int]


class Engine:
    def __init__(self, model_path: str, **options: Any) -> None:
        runner_keys = {f.name for f in fields(RunnerConfig)}
        sched_keys = {f.name for f in fields(SchedulerConfig)}
        unknown = set(options) - runner_keys - sched_keys
        if unknown:
            raise ValueError(f"unknown Engine option(s): {', '.join(sorted(unknown))}")
        runner_cfg = RunnerConfig(**{k: v for k, v in options.items() if k in runner_keys})
        sched_cfg = SchedulerConfig(**{k: v for k, v in options.items() if k in sched_keys})
        self.model_path = model_path
        self.tp_group: TPGroup | None = None
        tp = None
        if runner_cfg.tp_size > 1:  # this process is rank 0; the others are spawned
            if runner_cfg.nnodes > 1:
                raise ValueError("the Engine runs on one host (--nnodes 1)")
            configure_threads(rank_threads(runner_cfg), pick_default=False)
            self.tp_group, runner_cfg = TPGroup.start(model_path, runner_cfg, sched_cfg)
            tp = self.tp_group.tp
        try:
            self.scheduler = build_scheduler(model_path, runner_cfg, sched_cfg, tp)
        except BaseException:
            self.shutdown()
            raise
        self.runner = self.scheduler.runner
        self._ids = itertools.count()
        self.io = InProcessIO()
        self.loop = SchedulerLoop(self.scheduler, self.io)
        self._leader = None if tp is None else Leader(self.loop, tp, self.tp_group.failure)
        self._outputs: dict[str, RequestOutput] = {}  # by rid: requests someone waits for

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    def _message(
        self,
        prompt: Prompt,
        params: dict | SamplingParams | None,
        session_params: dict | SessionParams | None = None,
        cache_salt: str | None = None,
    ) -> GenerateMsg:
        sp = params if isinstance(params, SamplingParams) else SamplingParams(**(params or {}))
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        session = session_params
        if isinstance(session, SessionParams):
            session = asdict(session)
        return GenerateMsg(f"req-{next(self._ids)}", ids, sp, session, cache_salt)

    def _submit(self, msgs: list[GenerateMsg]) -> list[RequestOutput]:
        """Queue the requests in the loop; when one is refused, the ones queued before it are
        aborted and the refusal (ValueError, SessionError) is raised."""
        outs: list[RequestOutput] = []
        try:
            for msg in msgs:
                self.loop.call(msg)
                outs.append(self._outputs.setdefault(msg.rid, RequestOutput(msg.rid)))
        except Exception:
            for out in outs:
                self._forget(out.rid)
            raise
        return outs

    def _forget(self, rid: str) -> None:
        """Stop listening to `rid` and abort it if it still runs."""
        self._outputs.pop(rid, None)
        self.loop.call(AbortMsg(rid))

    def _pump(self, outs: list[RequestOutput]) -> None:
        """One round of the loop; its deltas go to the outputs that wait for them. RuntimeError
        when the scheduler is idle afterwards with some of `outs` unfinished."""
        self.loop.run_once()
        for d in self.io.take_deltas():
            out = self._outputs.get(d.rid)
            if out is not None:
                out.add(d)
                if out.finished:
                    del self._outputs[d.rid]
        if not all(o.finished for o in outs) and not self.scheduler.has_work():
            raise RuntimeError("scheduler went idle with unfinished requests")

    def _result(self, out: RequestOutput, params: SamplingParams) -> dict:
        return {
            "text": self.tokenizer.decode(out.output_ids),
            "output_ids": list(out.output_ids),
            "meta_info": out.meta_info(params.return_logprob, params.top_logprobs_num),
        }

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: dict | list[dict] | None = None,
        session_params: dict | SessionParams | None = None,
        cache_salt: str | None = None,
    ) -> list[dict] | dict:
        """Run all prompts concurrently to completion; one result per prompt, in order. With
        session_params (one prompt only) the prompt continues that session; `cache_salt`
        shares cached prefixes only with requests of the same salt. A refused prompt raises
        (ValueError, SessionError) and none of the batch runs."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if session_params is not None and len(batch) != 1:
            raise ValueError("a session request takes exactly one prompt")
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        )
        msgs = [
            self._message(p, sp, session_params, cache_salt)
            for p, sp in zip(batch, params, strict=True)
        ]
        outs = self._submit(msgs)
        while not all(o.finished for o in outs):
            self._pump(outs)
        results = [self._result(o, m.params) for o, m in zip(outs, msgs, strict=True)]
        return results[0] if single else results

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: dict | SamplingParams | None = None,
        session_params: dict | SessionParams | None = None,
    ) -> Iterator[dict]:
        """Yield {'output_ids': new ids, 'finish_reason': ...} as tokens arrive (other requests
        already queued keep running alongside); the last one also has `meta_info`. Closing the
        iterator early aborts the request."""
        msg = self._message(prompt, sampling_params, session_params)
        (out,) = self._submit([msg])
        sent = 0
        try:
            while not out.finished:
                self._pump([out])
                if len(out.output_ids) > sent:
                    yield {"output_ids": out.output_ids[sent:], "finish_reason": None}
                    sent = len(out.output_ids)
        finally:
            if not out.finished:
                self._forget(msg.rid)
        yield {
            "output_ids": out.output_ids[sent:],
            "finish_reason": out.finish_reason,
            "meta_info": self._result(out, msg.params)["meta_info"],
        }

    def open_session(
        self,
        session_id: str | None = None,
        capacity_of_str_len: int | None = None,
        streaming: bool = False,
        timeout: float | None = None,
    ) -> str:
        """A tree session by default (SGLang's rules), append-only with streaming; reaped by
        the loop `timeout` seconds after its last turn began."""
        return self._query(
            "open_session",
            session_id=session_id,
            capacity_of_str_len=capacity_of_str_len,
            streaming=streaming,
            session_timeout=timeout,
        )

    def _query(self, kind: str, **args: Any) -> Any:
        """A query applied at once (`SchedulerLoop._q_<kind>`): its result, or its refusal."""
        return self.loop.call(QueryMsg(0, kind, args))

    def close_session(self, session_id: str) -> bool:
        """Close a session; a turn still in flight is aborted (its output says so)."""
        closed = self._query("close_session", session_id=session_id)
        self.loop.flush()
        return closed

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without tensor parallelism)."""
        group, self.tp_group = self.tp_group, None
        if group is None:
            return
        if getattr(self, "_leader", None) is not None:
            self._leader.stop()
        group.stop()

    def leak_report(self) -> list[str]:
        """Pool problems (empty: clean); with tensor parallelism every rank's, named."""
        return self._query("leaks")

    def flush_cache(self) -> bool:
        """Free sessions' held slots and empty the radix tree; refused (False) while requests
        run."""
        try:
            self._query("flush")
        except ValueError:
            return False
        return True
