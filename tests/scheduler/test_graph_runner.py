"""Padded decode through `DecodeGraphRunner`: sizes, the static-buffer path (what CUDA graphs
replay) equal to the eager path, the capture-safe MoE, and on a GPU capture/replay itself."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels.experts import static_experts
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from tests.scheduler.helpers import StaticBuffers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=8)


def test_decode_graph_sizes():
    cfg = SchedulerConfig(cuda_graph_bs=(1, 2, 4, 8, 16), cuda_graph_max_bs=12)
    assert cfg.decode_graph_sizes(64) == [1, 2, 4, 8, 12]
    assert cfg.decode_graph_sizes(5) == [1, 2, 4, 5]
    assert SchedulerConfig(disable_cuda_graph=True).decode_graph_sizes(64) == []
    with pytest.raises(ValueError, match="cuda-graph"):
        SchedulerConfig(cuda_graph_max_bs=0)


def _prefilled(ckpt, device: str, prompts: list[list[int]]):
    model = load_model(ckpt, dtype="float32", device=device)
    runner = ModelRunner(model, RunnerConfig(max_running_requests=8, device=device))
    slots = [(runner.req_pool.alloc(1)[0], int(runner.mamba_pool.alloc(1)[0])) for _ in prompts]
    items = [ExtendInput(q, m, 0, p) for (q, m), p in zip(slots, prompts, strict=True)]
    locs = [runner.alloc_kv(q, 0, len(p)) for (q, _), p in zip(slots, prompts, strict=True)]
    first = runner.forward(runner.build_prefill(items, locs)).argmax(-1).tolist()
    return runner, slots, first


def _decode(runner, graphs, slots, prompts, first, steps):
    """Greedy decode steps through `graphs`; returns tokens and the last logits."""
    tokens, lens, out = list(first), [len(p) for p in prompts], []
    for _ in range(steps):
        items = [DecodeInput(q, m, lens[i], tokens[i]) for i, (q, m) in enumerate(slots)]
        loc = torch.cat([runner.alloc_kv(q, lens[i], 1) for i, (q, _) in enumerate(slots)])
        logits = graphs.forward(items, loc)
        tokens = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
        out.append(tokens)
    return out, logits


@pytest.mark.parametrize("n", [1, 3, 5])
def test_static_buffers_equal_eager_padded_decode(ckpt, n):
    torch.manual_seed(n)
    prompts = [torch.randint(3, 2000, (k,)).tolist() for k in (5, 17, 2, 30, 9)[:n]]
    sizes = [1, 2, 4, 8]
    eager, slots, first = _prefilled(ckpt, "cpu", prompts)
    want, want_logits = _decode(eager, DecodeGraphRunner(eager, sizes), slots, prompts, first, 6)
    static, slots2, first2 = _prefilled(ckpt, "cpu", prompts)
    graphs = StaticBuffers(static, sizes)
    assert sorted(graphs.batches) == sizes and not graphs.graphs
    got, got_logits = _decode(static, graphs, slots2, prompts, first2, 6)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)
    bs = graphs.padded_size(n)
    batch = graphs.batches[bs]
    assert batch.req_slots[n:].eq(0).all() and batch.mamba_slots[n:].eq(0).all()
    assert batch.out_loc[n:].eq(0).all() and batch.seq_lens[n:].eq(1).all()


def test_static_moe_equals_grouped_moe(ckpt):
    model = load_model(ckpt, dtype="float32")
    moe = next(m for m in model.modules() if type(m).__name__ == "Experts")
    torch.manual_seed(0)
    x = torch.randn(7, moe.gate_up_proj.shape[-1])
    ids = torch.stack([torch.randperm(moe.gate_up_proj.shape[0])[:2] for _ in range(7)])
    w = torch.rand(7, 2)
    static = static_experts(x, ids, w, moe.gate_up_proj, moe.down_proj)
    torch.testing.assert_close(static, moe(x, ids, w), atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(ckpt):
    prompts = [[5, 6, 7], list(range(3, 40)), [9] * 12]
    eager, slots, first = _prefilled(ckpt, "cuda", prompts)
    plain = DecodeGraphRunner(eager, [1, 2, 4], use_graphs=False)
    want, want_logits = _decode(eager, plain, slots, prompts, first, 8)
    replay, slots2, first2 = _prefilled(ckpt, "cuda", prompts)
    graphs = DecodeGraphRunner(replay, [1, 2, 4], use_graphs=True)
    assert sorted(graphs.graphs) == [1, 2, 4]
    got, got_logits = _decode(replay, graphs, slots2, prompts, first2, 8)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
