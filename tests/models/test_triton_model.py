"""The whole model with every kernel forced to Triton (on CUDA, or in the interpreter without it)
against the torch path on the same device: same greedy tokens for a short ragged batch that is
prefilled in two rounds (the second continues from cached KV and Mamba states) and then decoded
in a padded batch."""

from __future__ import annotations

import torch

from hybrid_serve.make_model.presets import write_preset
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig

PROMPT_LENS = [3, 21]
FIRST_ROUND = 12  # tokens per request in the first prefill round
DECODE_STEPS = 2


def greedy(model, prompts: list[list[int]], device: str) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per prompt, and the logits of the first decode step."""
    config = RunnerConfig(max_running_requests=4, max_total_tokens=256, device=device)
    runner = ModelRunner(model, config)
    n = len(prompts)
    slots = list(zip(runner.req_pool.alloc(n), runner.mamba_pool.alloc(n).tolist(), strict=True))
    done = [0] * len(prompts)
    last = {}
    for budget in (FIRST_ROUND, None):
        items, locs, owners = [], [], []
        for i, (p, (req, mamba)) in enumerate(zip(prompts, slots, strict=True)):
            ids = p[done[i] : done[i] + budget] if budget else p[done[i] :]
            if not ids:
                continue
            items.append(ExtendInput(req, mamba, done[i], ids))
            locs.append(runner.alloc_kv(req, done[i], len(ids)))
            owners.append(i)
            done[i] += len(ids)
        if not items:  # every prompt fit in the first round
            continue
        logits = runner.forward(runner.build_prefill(items, locs))
        last.update({i: logits[row] for row, i in enumerate(owners)})
    tokens = [int(last[i].argmax()) for i in range(len(prompts))]
    outputs = [[t] for t in tokens]
    seq_lens = [len(p) for p in prompts]
    first_decode = None
    for _ in range(DECODE_STEPS):
        items = [DecodeInput(r, m, seq_lens[i], tokens[i]) for i, (r, m) in enumerate(slots)]
        locs = runner.alloc_decode_kv([r for r, _ in slots], seq_lens)
        logits = runner.forward(runner.build_decode(items, locs, pad_to=len(slots) + 2))
        first_decode = logits[: len(slots)] if first_decode is None else first_decode
        tokens = logits[: len(slots)].argmax(-1).tolist()
        seq_lens = [s + 1 for s in seq_lens]
        for out, t in zip(outputs, tokens, strict=True):
            out.append(t)
    return outputs, first_decode


def test_tiny_model_triton_matches_torch(tmp_path, triton_device, kernels_mode) -> None:
    dev = str(triton_device)
    model = load_model(write_preset("tiny", tmp_path, seed=3), dtype="float32", device=dev)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    kernels_mode("torch", model)
    ref_tokens, ref_logits = greedy(model, prompts, dev)
    kernels_mode("triton", model)
    tokens, logits = greedy(model, prompts, dev)

    ops = model.ops
    used = {
        getattr(ops, f).__module__
        for f in (
            "causal_conv1d_fn",
            "chunk_gated_delta_rule",
            "extend_attention",
            "rms_norm_gated",
        )
    }
    assert ops.backend == "triton" and used == {
        "hybrid_serve.kernels.causal_conv1d_triton",
        "hybrid_serve.kernels.gated_delta_rule_triton",
        "hybrid_serve.kernels.attention_triton",
        "hybrid_serve.kernels.rmsnorm_triton",
    }
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-3
