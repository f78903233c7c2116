"""`--quantization int8|int4` on CPU: which matrices are quantized, the served model against
transformers on the dequantized checkpoint (the same numbers in fp32), its products with those
matrices taking their inputs rounded to int8 as ours do (`rounded_inputs`), through the
scheduler's paths, and its distance from the fp32 model on the tiny preset."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybrid_serve.kernels.bf16_pack import plain_rows
from hybrid_serve.kernels.kernel_set import reference_set
from hybrid_serve.kernels.quant import GROUP, dequantize, in_features, quantize, round_activations
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)

NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
KEPT = (
    "embed_tokens",
    "mlp.gate.weight",
    "shared_expert_gate",
    "norm",
    "conv1d",
    "A_log",
    "dt_bias",
)  # fmt: skip  (what the loader leaves unquantized)


def quantized_name(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not any(k in name for k in KEPT)


@contextmanager
def rounded_inputs(model: torch.nn.Module) -> Iterator[None]:
    """Within: every `F.linear` with one of `model`'s would-be-quantized matrices (or a slice of
    a stack of them) takes its input rounded to int8 (`round_activations`), as the quantized
    model's products do; the other products as they are. (Our reference experts take their
    per-expert `F.linear` path, not `torch._grouped_mm`.)"""
    storages = {p.untyped_storage().data_ptr() for n, p in model.named_parameters()
                if quantized_name(n, p)}  # fmt: skip
    plain = F.linear

    def linear(x, w, b=None):
        if w.untyped_storage().data_ptr() in storages:
            x = round_activations(x).to(x.dtype)
        return plain(x, w, b)

    with (
        mock.patch("torch.nn.functional.linear", linear),
        mock.patch("hybrid_serve.kernels.experts.grouped_mm_fits", return_value=False),
    ):
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)


@pytest.fixture(scope="module", params=["int8", "int4"])
def ckpts(request, tiny, tmp_path_factory):
    """(the tiny preset, its twin whose matrices hold their quantized values in fp32, the
    method): per-row scales and groups along K are the same whether a checkpoint stores experts
    apart or stacked, and whatever the row order of a fused projection."""
    path, method = tiny, request.param
    twin = tmp_path_factory.mktemp("dequantized")
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, twin / f.name)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if quantized_name(name, t):
                tensors[name] = dequantize(quantize(t, method)).to(t.dtype)
        save_file(tensors, twin / f.name)
    assert not json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    return path, twin, method


def test_what_is_quantized(ckpts) -> None:
    path, _, method = ckpts
    model = load_model(path, dtype="float32", quantization=method)
    forms = {n: p.dtype for n, p in model.named_parameters()}
    quantized = {n for n, d in forms.items() if d in (torch.int8, torch.uint8)}
    assert "lm_head.weight" in quantized and any("experts.gate_up_proj" in n for n in quantized)
    assert any("shared_expert.down_proj" in n for n in quantized)
    assert any("in_proj_ba" in n for n in quantized)
    assert any("self_attn.o_proj" in n for n in quantized)
    for name, dtype in forms.items():
        if name not in quantized:
            assert dtype == torch.float32, name
            assert any(k in name for k in KEPT), name
    if method == "int4":  # int8 exactly where K does not divide into groups of 32
        for name, p in model.named_parameters():
            if name in quantized:
                assert (p.dtype == torch.uint8) == (in_features(p) % GROUP == 0), name
        assert torch.uint8 in {forms[n] for n in quantized}
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, got 'int3'"):
        load_model(path, quantization="int3")


# How far the logits may move from the fp32 model's: random weights amplify every rounding
# through the layers (bf16 matrices move the tiny preset's logits by 5-60% of their norm,
# depending on the seed). Per weight int8 rounds ~5x coarser than bf16: within 4x bf16's
# distance. int4 rounds ~40x coarser and its logits decorrelate from the fp32 model's: relative
# distance 0.84-1.34 per row at seeds 0-5 of the present preset draw and 0-3 of the one before
# issue 56 moved the Qwen presets onto transformers' model. A multiple of bf16's distance held
# only where bf16's happened to be large (seed 3's earlier draw: 8x held at 0.9 against 0.21;
# its present draw: 1.1 against 0.068), so int4's bound is the distance of unrelated logits of
# equal norm, sqrt(2).
BOUND_VS_BF16 = {"int8": 4.0}
DECORRELATED = 2**0.5


# How far the C++ kernels' logits may be from the torch references' on the quantized tiny preset:
# where an input differs in its last bit (fp32 summation order) a rounding to int8 can flip by a
# whole step, and the random weights amplify it (a 1-ulp change of every quantized product's
# input moves these logits by ~1%; the rounding as a whole moves them by ~35%). The references'
# own sums follow the host's BLAS dispatch, so the distance does too: 0.115-0.117 on an AMX Xeon
# at every level of ours (generic, x86-64-v3, sapphirerapids), under 0.1 on an AVX2 EPYC.
FLIP_BOUND = 0.2


def test_logits_match_the_dequantized_model(ckpts) -> None:
    """Prefill and decode logits of the quantized model through the torch references equal those
    of the fp32 model on the dequantized twin, its quantized matrices' products taking rounded
    inputs; the C++ kernels' are within FLIP_BOUND of them; against the unquantized model they
    differ by at most BOUND_VS_BF16 times bf16's distance (int4: DECORRELATED)."""
    path, twin_path, method = ckpts
    prompt = torch.randint(3, 200, (33,), generator=torch.Generator().manual_seed(1)).tolist()
    quant, ref, full, bf16 = (
        logits(load_model(p, dtype=d, quantization=q, ops=o), prompt)
        for p, d, q, o in ((path, "float32", method, None),
                           (path, "float32", method, reference_set()),
                           (path, "float32", None, None), (path, "bfloat16", None, None))
    )  # fmt: skip
    twin_model = load_model(twin_path, dtype="float32", ops=reference_set())
    with rounded_inputs(twin_model):
        twin = logits(twin_model, prompt)
    assert ((ref - twin).norm() / twin.norm()).item() < 1e-6
    assert ((quant - twin).norm() / twin.norm()).item() < FLIP_BOUND
    rel, rel_bf16 = (((x - full).norm() / full.norm()).item() for x in (quant, bf16))
    bound = BOUND_VS_BF16[method] * rel_bf16 if method in BOUND_VS_BF16 else DECORRELATED
    assert 0 < rel < bound, (rel, rel_bf16)


def logits(model, prompt: list[int]) -> torch.Tensor:
    """The prompt's last prefill logits, then one decode step's (token 5)."""
    runner = ModelRunner(model, RunnerConfig(max_running_requests=2, max_total_tokens=256))
    req, slot = runner.req_pool.alloc(1)[0], int(runner.mamba_pool.alloc(1)[0])
    loc = runner.alloc_kv(req, 0, len(prompt))
    first = runner.forward(runner.build_prefill([ExtendInput(req, slot, 0, prompt)], [loc]))
    out_loc = runner.alloc_kv(req, len(prompt), 1)
    step = runner.forward(runner.build_decode([DecodeInput(req, slot, len(prompt), 5)], out_loc))
    return torch.cat([first, step])


@pytest.mark.parametrize(
    "mode",
    [
        {"disable_radix_cache": True, "chunked_prefill_size": -1},
        {"mamba_scheduler_strategy": "no_buffer", "chunked_prefill_size": 16},
        {"mamba_scheduler_strategy": "extra_buffer", "chunked_prefill_size": 16},
    ],
)
def test_served_tokens_are_greedy_for_transformers_on_the_twin(ckpts, mode) -> None:
    """Greedy tokens through the scheduler (prefix hits, chunked prefill, batched decode on the
    CPU decode plan) are transformers' greedy choices on the dequantized twin, to within the
    rounding flips (`assert_near_greedy`); the pools come back whole."""
    path, twin, method = ckpts
    hf = hf_twin(twin)
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(3, 200, (40,), generator=gen).tolist()
    prompts = [base, base + [7, 8, 9], base[:25] + [11] * 6, [5, 6, 7]]
    engine = Engine(str(path), quantization=method, max_running_requests=4,
                    max_total_tokens=2048, **mode)  # fmt: skip
    outs = [engine.generate(prompts[0], GREEDY)["output_ids"]]
    outs += [o["output_ids"] for o in engine.generate(prompts[1:], GREEDY)]
    for prompt, out in zip(prompts, outs, strict=True):
        assert_near_greedy(hf, prompt, out)
    assert engine.leak_report() == []


def hf_twin(twin) -> torch.nn.Module:
    """transformers' model of the dequantized twin, its experts on their per-expert `F.linear`
    path (which `rounded_inputs` sees; its default `grouped_mm` path would not)."""
    return AutoModelForCausalLM.from_pretrained(
        twin, dtype=torch.float32, experts_implementation="eager"
    ).eval()


# How far below transformers' top logit a served token's may be, in standard deviations of the
# step's logits: the C++ products' rounding flips (FLIP_BOUND) leave the tiny preset's served
# tokens up to ~0.16 of them below (twice that is allowed); a token from a wrong state or prefix
# would be anywhere among the 2048, typically ~3.5 below.
MARGIN = 0.3


def assert_near_greedy(hf, prompt: list[int], served: list[int]) -> None:
    """Each served token is within MARGIN of transformers' top logit (on the twin, its
    quantized matrices' products taking rounded inputs) after the prompt and the tokens served
    before it, teacher-forced; most are its argmax."""
    assert len(served) == NEW
    with rounded_inputs(hf), torch.no_grad():
        steps = hf(torch.tensor([prompt + served])).logits[0, len(prompt) - 1 : -1]  # [NEW, V]
    top = steps.max(dim=-1)
    gap = (top.values - steps[torch.arange(NEW), served]) / steps.std(dim=-1)
    assert (gap <= MARGIN).all(), gap
    # most are its argmax: 7 of 10 in a session turn on an AMX Xeon, whose BLAS sums the twin's
    # products in another order than an AVX2 EPYC's (8 of 10 there), the others near-ties
    assert (gap == 0).float().mean() >= 0.6, gap


def test_serve_flag() -> None:
    from tests.serve_args import parse_serve_args

    _, runner, _ = parse_serve_args(["--model-path", "/x", "--quantization", "int8"])
    assert runner.quantization == "int8"
    assert parse_serve_args(["--model-path", "/x"])[1].quantization is None
    with pytest.raises(ValueError, match="--quantization must be one of int8, int4, got 'fp4'"):
        parse_serve_args(["--quantization", "fp4"])
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU only"):
        parse_serve_args(["--quantization", "int8", "--device", "cuda"])


def test_session_turns_are_greedy_for_transformers_on_the_twin(ckpts) -> None:
    """A three-turn session (each turn prefilling only its new tokens over the held state)
    serves transformers' greedy tokens on the dequantized twin for the whole context, to within
    the rounding flips (`assert_near_greedy`)."""
    path, twin, method = ckpts
    hf = hf_twin(twin)
    gen = torch.Generator().manual_seed(8)
    engine = Engine(str(path), quantization=method, max_running_requests=4,
                    max_total_tokens=2048)  # fmt: skip
    sid = engine.open_session(capacity_of_str_len=1000)
    context: list[int] = []
    rid = None
    for n in (30, 7, 12):
        new = torch.randint(3, 200, (n,), generator=gen).tolist()
        out = engine.generate(new, GREEDY, session_params={"id": sid, "rid": rid})
        assert_near_greedy(hf, context + new, out["output_ids"])
        context += new + out["output_ids"]
        rid = out["meta_info"]["id"]
    assert engine.close_session(sid)
    assert engine.leak_report() == []


def test_fp8_checkpoint_quantizes_its_dequantized_weights(tmp_path) -> None:
    """From a block-FP8 checkpoint, each quantized matrix is the quantization of the matrix the
    FP8 loader serves (dequantized, then the serving dtype)."""
    path = write_checkpoint(tmp_path, preset_config("tiny"), seed=5, dtype=torch.bfloat16,
                            fp8_block=(32, 64))  # fmt: skip
    served = load_model(path, dtype="bfloat16")
    route = served.ops.bf16_products  # its bf16 matrices in panels (`kernels.bf16_pack`)
    plain = {n: plain_rows(p.detach(), route) for n, p in served.named_parameters()}
    for method in ("int8", "int4"):
        model = load_model(path, dtype="bfloat16", quantization=method)
        for name, p in model.named_parameters():
            if p.dtype in (torch.int8, torch.uint8):
                assert torch.equal(p, quantize(plain[name], method)), name
