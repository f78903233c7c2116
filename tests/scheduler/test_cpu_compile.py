"""The compiled CPU decode step (`DecodeGraphRunner` with `cpu_compile`): equal to the eager step,
and its fallbacks. Two graphs are compiled in this module (tiny preset: batch 1, and the
dynamic batch graph traced at 2 rows; 10-20 s each on a quiet 2-core machine, minutes under
load); every other test engine runs eagerly (`cpu_compile="off"`)."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import cpp_build, custom_ops, dispatch
from models.loader import load_model
from models.presets import preset_config, write_checkpoint
from scheduler import cpu_compile, graph_runner
from scheduler.config import SchedulerConfig
from scheduler.graph_runner import DecodeGraphRunner
from scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig

PROMPTS = [[5, 17, 2, 30, 9], [44, 3], list(range(3, 40)), [7] * 11]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=8)


def prefilled(ckpt) -> tuple[ModelRunner, list[tuple[int, int]], list[int]]:
    runner = ModelRunner(load_model(ckpt, dtype="float32"), RunnerConfig(max_running_requests=8))
    slots = [(runner.req_pool.alloc(1)[0], int(runner.mamba_pool.alloc(1)[0])) for _ in PROMPTS]
    items = [ExtendInput(q, m, 0, p) for (q, m), p in zip(slots, PROMPTS, strict=True)]
    locs = [runner.alloc_kv(q, 0, len(p)) for (q, _), p in zip(slots, PROMPTS, strict=True)]
    first = runner.forward(runner.build_prefill(items, locs)).argmax(-1).tolist()
    return runner, slots, first


def decode(graphs: DecodeGraphRunner, slots, first, batch_sizes) -> list[torch.Tensor]:
    """Greedy steps; step i decodes the first batch_sizes[i] requests. Returns every logits."""
    runner = graphs.runner
    tokens, lens, out = list(first), [len(p) for p in PROMPTS], []
    for n in batch_sizes:
        items = [DecodeInput(q, m, lens[i], tokens[i]) for i, (q, m) in enumerate(slots[:n])]
        loc = torch.cat([runner.alloc_kv(q, lens[i], 1) for i, (q, _) in enumerate(slots[:n])])
        logits = graphs.forward(items, loc)
        out.append(logits)
        tokens[:n] = logits.argmax(-1).tolist()
        lens[:n] = [k + 1 for k in lens[:n]]
    return out


def test_compiled_decode_equals_eager(ckpt):
    """The batch-1 graph and one dynamic-batch graph serve batches of 1 to 4 (no padding, no
    recompile): greedy tokens identical and fp32 logits within 1e-4 of the eager step, pools
    updated alike."""
    steps = [4, 3, 1, 4, 2, 4, 1, 4]
    runner, slots2, first2 = prefilled(ckpt)
    dispatch.reset()  # no decode op chosen yet: compiling must make the choices itself
    graphs = DecodeGraphRunner(runner, [1, 4], cpu_compile="dynamic")
    assert graphs.compiled is not None, "compiling failed (see the warning above)"
    # the graph calls the C++ fused decode ops, as the eager step does, where they are built
    assert custom_ops.fused_in_graphs() == cpp_build.available()
    eager, slots, first = prefilled(ckpt)
    want = decode(DecodeGraphRunner(eager, [4]), slots, first, steps)
    assert graphs.compiled.sizes == {1, 2} and graphs.sizes == [] and not graphs.batches
    graphs.compiled.stance = "fail_on_recompile"  # every step must hit the one graph
    got = decode(graphs, slots2, first2, steps)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape  # run at the batch's own size
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist()
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    # live state alike (slot 0 and KV location 0 are the padding scratch compiling wrote to)
    for a, b in ((runner.mamba_pool.ssm_state, eager.mamba_pool.ssm_state),
                 (runner.mamba_pool.conv_state, eager.mamba_pool.conv_state),
                 (runner.kv_pool.k_all, eager.kv_pool.k_all)):  # fmt: skip
        torch.testing.assert_close(a[:, 1:], b[:, 1:], atol=1e-4, rtol=0)


def test_no_compiler_runs_eagerly_with_one_warning(ckpt, monkeypatch, caplog):
    monkeypatch.setattr(graph_runner, "cxx_compiler", lambda: None)
    runner, slots, first = prefilled(ckpt)
    with caplog.at_level(logging.WARNING, logger=graph_runner.__name__):
        graphs = DecodeGraphRunner(runner, [1, 2, 4], cpu_compile="per_size")
    assert graphs.compiled is None and graphs.sizes == [] and not graphs.batches
    assert [r.getMessage() for r in caplog.records].count(
        "no C++ compiler found: the CPU decode step runs eagerly (not compiled)"
    ) == 1 and len(caplog.records) == 1
    logits = decode(graphs, slots, first, [3])[0]
    assert logits.shape[0] == 3  # not padded to 4: nothing was compiled for it


def test_compile_error_runs_eagerly_with_one_warning(ckpt, monkeypatch, caplog):
    def fail(self, bs, batch):
        raise RuntimeError("inductor: no luck\nsecond line")

    monkeypatch.setattr(cpu_compile.CompiledDecode, "compile", fail)
    runner, slots, first = prefilled(ckpt)
    with caplog.at_level(logging.WARNING, logger=graph_runner.__name__):
        graphs = DecodeGraphRunner(runner, [1, 2, 4], cpu_compile="per_size")
    assert graphs.compiled is None and graphs.sizes == [] and not graphs.batches
    assert [r.getMessage() for r in caplog.records] == [
        "compiling the CPU decode step failed, running it eagerly: RuntimeError: inductor: no luck"
    ]
    assert decode(graphs, slots, first, [3])[0].shape[0] == 3


def test_cpu_compile_config():
    with pytest.raises(ValueError, match="--cpu-compile"):
        SchedulerConfig(cpu_compile="always")
    assert SchedulerConfig().cpu_compile == "off"  # start-up compiles otherwise (BENCHMARKS.md)
    assert SchedulerConfig(disable_cuda_graph=True).decode_graph_sizes(64) == []  # nothing to do
