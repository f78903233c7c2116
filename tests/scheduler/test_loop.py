"""One loop for everyone: `SchedulerLoop` over pipes (the server process) gives the same tokens
and results as over the in-process queue (the `Engine`) and as `hybrid-serve generate`, which
now honours stop tokens."""

from __future__ import annotations

import logging
import threading
from multiprocessing import Pipe

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.loop import SchedulerLoop
from hybrid_serve.scheduler.loop_io import PipeIO
from hybrid_serve.scheduler.messages import (
    AbortMsg,
    GenerateMsg,
    Heartbeat,
    QueryMsg,
    QueryReply,
    RequestOutput,
    ShutdownMsg,
)
from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.server.cli import main as cli_main

OPTIONS = {"max_running_requests": 4, "max_total_tokens": 1024, "chunked_prefill_size": 16}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=5))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (7, 30, 12)]
    engine = Engine(path, **OPTIONS)
    expected = engine.generate(prompts, {**GREEDY, "return_logprob": True})
    return path, prompts, expected, engine


def test_pipe_loop_matches_the_engine(setup):
    """The server's path (messages over pipes, a thread running `run()`) returns what
    `Engine.generate` returns, answers queries between steps, and stops on ShutdownMsg."""
    path, prompts, expected, _ = setup
    engine = Engine(path, **OPTIONS)  # only its scheduler is used, through a pipe loop
    loop_in, api_out = Pipe(duplex=False)
    api_in, loop_out = Pipe(duplex=False)
    loop = SchedulerLoop(engine.scheduler, PipeIO(loop_in, loop_out))
    thread = threading.Thread(target=loop.run, daemon=True)
    params = SamplingParams(**GREEDY, return_logprob=True)
    for i, p in enumerate(prompts):
        api_out.send(GenerateMsg(f"r{i}", p, params))
    api_out.send(GenerateMsg("gone", prompts[0], SamplingParams(**GREEDY)))
    api_out.send(AbortMsg("gone"))
    api_out.send(QueryMsg(qid=7, kind="ping"))
    # the loop starts with every message waiting, so its first round batches the prompts as
    # `Engine.generate` does: a batch's row count picks the products (GEMV or GEMM), and a
    # request arriving a round late would batch differently, within one rounding
    thread.start()
    outs = {f"r{i}": RequestOutput(f"r{i}") for i in range(len(prompts))} | {
        "gone": RequestOutput("gone")
    }
    replies, beats = [], 0
    while not all(o.finished for o in outs.values()) or not replies:
        assert api_in.poll(60), "the loop stopped answering"
        msg = api_in.recv()
        if isinstance(msg, Heartbeat):
            beats += 1
            continue
        if isinstance(msg, QueryReply):
            replies.append(msg)
            continue
        for d in msg:
            outs[d.rid].add(d)
    assert [(r.qid, r.ok, r.result) for r in replies] == [(7, True, True)]
    assert beats >= 1  # the first round beats at once
    assert outs["gone"].finish_reason == "abort"
    for i, exp in enumerate(expected):
        out = outs[f"r{i}"]
        assert out.output_ids == exp["output_ids"]
        assert out.meta_info(True) == exp["meta_info"] | {"id": f"r{i}"}
    api_out.send(ShutdownMsg())
    thread.join(30)
    assert not thread.is_alive()
    assert engine.leak_report() == []


def test_engine_refusal_aborts_the_batch_and_streams_can_be_left(setup):
    """A refused prompt raises and none of its batch keeps running; leaving a stream early
    aborts its request; the pools end where they began."""
    _, prompts, expected, engine = setup
    with pytest.raises(ValueError, match="context"):
        engine.generate([prompts[0], list(range(3, 5000))], GREEDY)
    assert not engine.scheduler.has_work()
    stream = engine.generate_stream(prompts[1], GREEDY)
    first = next(stream)
    assert first["output_ids"] == expected[1]["output_ids"][: len(first["output_ids"])]
    stream.close()
    assert not engine.scheduler.has_work()
    chunks = list(engine.generate_stream(prompts[2], GREEDY))
    assert [t for c in chunks for t in c["output_ids"]] == expected[2]["output_ids"]
    assert chunks[-1]["finish_reason"] == "length"
    engine.flush_cache()
    assert engine.leak_report() == []


def test_generate_command_honours_stop_token_ids(setup, capsys, caplog):
    """`hybrid-serve generate` runs the Engine: a stop token ends the output there."""
    path, _, _, engine = setup
    prompt = "The answer to 12 + 30 is"
    full = engine.generate(prompt, GREEDY)["output_ids"]
    stop = full[3]
    cut = full.index(stop) + 1  # the first time it comes
    base = ["generate", "--model-path", path, "--prompt", prompt, "--max-new-tokens", "8"]
    with caplog.at_level(logging.INFO, logger="hybrid-serve"):
        cli_main([*base, "--ignore-eos", "--stop-token-ids", str(stop)])
    assert capsys.readouterr().out == engine.tokenizer.decode(full[:cut]) + "\n"
    assert f"+ {cut} new tokens" in caplog.text and "finish reason stop" in caplog.text
