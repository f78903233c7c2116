"""`--dtype bfloat16` on CPU: bf16 matrices, everything else fp32, close to the fp32 model
(benchmarks/fidelity.py measures how close over the GSM8K prompts). The products here are the
exact ones on the bf16 weights (`HYBRID_SERVE_BF16_PRODUCTS=off`); the bf16 products at batch
are tests/kernels/test_bf16_products.py's and tests/models/test_cpu_decode.py's."""

from __future__ import annotations

import torch

from hybrid_serve.kernels import KernelSettings, choose
from hybrid_serve.kernels.bf16_pack import pack_bf16, plain_rows
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.layers import Linear
from hybrid_serve.models.loader import cast_matrices, load_model
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig


def _logits(runner: ModelRunner, prompt: list[int], next_id: int) -> torch.Tensor:
    """Prefill logits of the prompt's last token, then one decode step's."""
    req = runner.req_pool.alloc(1)[0]
    slot = int(runner.mamba_pool.alloc(1)[0])
    loc = runner.alloc_kv(req, 0, len(prompt))
    first = runner.forward(runner.build_prefill([ExtendInput(req, slot, 0, prompt)], [loc]))
    out_loc = runner.alloc_kv(req, len(prompt), 1)
    step = runner.forward(
        runner.build_decode([DecodeInput(req, slot, len(prompt), next_id)], out_loc)
    )
    return torch.cat([first, step])


def test_bf16_weights_fp32_rest(tmp_path) -> None:
    path = write_checkpoint(tmp_path, {**preset_config("tiny"), "tie_word_embeddings": True})
    exact = choose("cpu", settings=KernelSettings(bf16_products="off"))
    fp32, bf16 = load_model(path, dtype="float32"), load_model(path, dtype="bfloat16", ops=exact)

    def is_matrix(name: str, p: torch.Tensor) -> bool:  # linear weights and stacked experts
        return (p.dim() == 2 and "embed_tokens" not in name) or name.endswith("_proj")

    matrices = {n for n, p in bf16.named_parameters() if is_matrix(n, p)}
    assert "lm_head.weight" in matrices and len(matrices) > 20
    for name, p in bf16.named_parameters():
        want = torch.bfloat16 if name in matrices else torch.float32
        assert p.dtype == want, name
    assert bf16.model.embed_tokens.weight.dtype == torch.float32  # untied from the bf16 head

    # the judge: the fp32 model with its matrices rounded to bf16 (the same numbers, fp32 math)
    rounded = load_model(path, dtype="float32")
    cast_matrices(rounded, torch.bfloat16)  # leaves the tied head alone: the loader copies it
    embedding = rounded.model.embed_tokens.weight
    rounded.lm_head.weight = torch.nn.Parameter(embedding.detach().to(torch.bfloat16))
    for p in rounded.parameters():
        p.data = p.data.float()

    cfg = RunnerConfig(max_running_requests=2, max_total_tokens=256, max_context_len=128)
    runner = ModelRunner(bf16, cfg)
    assert runner.mamba_pool.conv_state.dtype == torch.float32
    assert runner.kv_pool._k.dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, fp32.config.vocab_size, (40,), generator=gen).tolist()
    out = _logits(runner, prompt, 5)
    ref = _logits(ModelRunner(rounded, cfg), prompt, 5)
    full = _logits(ModelRunner(fp32, cfg), prompt, 5)
    assert out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 1e-4  # fp32 accumulation: only the weights differ
    assert not torch.allclose(out, full, atol=1e-3)  # and they do differ from fp32's


def test_the_bf16_route_loads_every_bf16_matrix_in_panels(tmp_path) -> None:
    """One rule (`kernels.bf16_pack`): with the bf16 route (forced on, so on any CPU) every bf16
    parameter is its matrix in K-pair panels, the tied head's own copy and the float-kept
    routers included, in the same bytes; without it, the same matrices in row order. The two
    loads then serve logits about as far apart as the exact bf16 products are from fp32's
    (random weights amplify every rounding; their flat logits leave near-ties that rounding may
    flip, so no greedy token is compared here: the route's fidelity on trained weights is
    benchmarks/fidelity.py's)."""
    cfg = {**preset_config("tiny"), "tie_word_embeddings": True}
    path = write_checkpoint(tmp_path, cfg)
    on = choose("cpu", settings=KernelSettings(bf16_products="on"))
    off = choose("cpu", settings=KernelSettings(bf16_products="off"))
    packed, rows = load_model(path, "bfloat16", ops=on), load_model(path, "bfloat16", ops=off)
    n = 0
    pairs = zip(packed.named_parameters(), rows.named_parameters(), strict=True)
    for (name, p), (name2, q) in pairs:
        assert name == name2 and p.dtype == q.dtype and p.shape == q.shape, name
        assert p.untyped_storage().nbytes() == q.untyped_storage().nbytes(), name
        if p.dtype == torch.bfloat16:
            n += 1
            assert torch.equal(p, pack_bf16(q)), name
            assert torch.equal(plain_rows(p, True), q) and plain_rows(q, False) is q
        else:
            assert torch.equal(p, q), name
    assert n > 20 and packed.lm_head.weight.dtype == torch.bfloat16
    assert any(m.keep_float for m in packed.modules() if isinstance(m, Linear))
    cfg_run = RunnerConfig(max_running_requests=2, max_total_tokens=256, max_context_len=128)
    prompt = list(range(3, 40))
    got = _logits(ModelRunner(packed, cfg_run), prompt, 5)
    want = _logits(ModelRunner(rows, cfg_run), prompt, 5)
    full = _logits(ModelRunner(load_model(path, "float32"), cfg_run), prompt, 5)
    assert (got - want).norm() < 3 * (want - full).norm()  # as far as bf16 weights are from fp32
