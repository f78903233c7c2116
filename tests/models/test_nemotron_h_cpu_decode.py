"""NemotronH's CPU decode plan (`models.cpu_decode.CpuDecodePlan`): bit for bit the eager
decode step, logits and pools (conv and SSM states, KV), on the tiny preset (every block kind)
and a variant without the conv bias and with a clamping dt limit; bit for bit the eager verify
of a speculative batch (the tiny preset, and Nemotron 3 Super's with its MTP head and latent
MoE); and where it does not apply."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models import plan_refusal
from hybrid_serve.models.cpu_decode import CpuDecodePlan
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)
from tests.models import plan_harness
from tests.models.plan_harness import assert_steps_alike, pools

PROMPTS = plan_harness.PROMPTS[:10]
PLAN_ROWS = 10  # beyond the GEMV's 8 rows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("nemotron-h"), preset_config("tiny-nemotron-h"), seed=3
    )


@pytest.fixture(scope="module")
def variant_ckpt(tmp_path_factory):
    """No conv bias, a clamping dt limit (transformers' native NemotronH clamp, as a config)."""
    cfg = {**preset_config("tiny-nemotron-h"), "use_conv_bias": False}
    cfg["time_step_limit"] = [0.01, 0.05]
    return write_checkpoint(tmp_path_factory.mktemp("variant"), cfg, seed=4)


@pytest.fixture(scope="module")
def super_ckpt(tmp_path_factory):
    """Nemotron 3 Super's tiny preset: latent MoE, and an MTP head (the verify batches' source)."""
    cfg = preset_config("tiny-nemotron-3-super")
    return write_checkpoint(tmp_path_factory.mktemp("super"), cfg, seed=5)


def prefilled(ckpt):
    return plan_harness.prefilled(ckpt, prompts=PROMPTS)


@pytest.mark.parametrize("which", ["ckpt", "variant_ckpt"])
def test_plan_equals_eager_bit_for_bit(request, which):
    """Greedy steps of 1 to PLAN_ROWS requests (the GEMV's rows and the GEMM's): identical
    logits and identical pools after every step."""
    ckpt = request.getfixturevalue(which)
    eager, slots, first = prefilled(ckpt)
    fast, slots2, first2 = prefilled(ckpt)
    assert slots == slots2 and first == first2
    if which == "variant_ckpt":
        mixer = fast.model.backbone.layers[0].mixer
        assert mixer.conv1d.bias is None and mixer.config.time_step_limit == (0.01, 0.05)
    plain = DecodeGraphRunner(eager, [])  # no sizes: no plan, every batch eager
    planned = DecodeGraphRunner(fast, [1, 2, 4, 8, PLAN_ROWS])
    assert plain.plan is None and isinstance(planned.plan, CpuDecodePlan)
    assert_steps_alike(plain, planned, slots, first, PROMPTS, [1, 3, PLAN_ROWS, 2, 9, 1])


@pytest.mark.parametrize("drafts", [2, 4])
@pytest.mark.parametrize("which", ["ckpt", "super_ckpt"])
def test_plan_verify_equals_the_eager_verify_bit_for_bit(request, which, drafts):
    """A speculative verify batch (requests of 1 to drafts + 1 rows at consecutive positions,
    their Mamba2 states kept in step slots): through the plan (`BlockStep.verify`: mamba2_verify,
    the eager extend attention) as through the model's extend forward, identical logits and
    hidden states, and identical pools (the step slots' states included)."""
    ckpt = request.getfixturevalue(which)
    eager, slots, first = prefilled(ckpt)
    fast, _, _ = prefilled(ckpt)
    plain, planned = DecodeGraphRunner(eager, []), DecodeGraphRunner(fast, [1, 2, 4, 8])
    assert plain.plan is None and planned.plan is not None and planned.plan.verifies

    def no_eager(*args, **kwargs):
        raise AssertionError("the planned verify ran the eager model")

    fast.model.final_hidden = no_eager
    lens = [drafts + 1, 1, drafts, drafts + 1]
    outs = []
    for graphs in (plain, planned):
        runner = graphs.runner
        items, locs = [], []
        for i, n in enumerate(lens):
            q, m = slots[i]
            steps = [int(s) for s in runner.mamba_pool.alloc(n - 1)] if n > 1 else []
            ids = [first[i], *range(10, 9 + n)]
            items.append(ExtendInput(q, m, len(PROMPTS[i]), ids, step_slots=steps))
            locs.append(runner.alloc_kv(q, len(PROMPTS[i]), n))
        batch = runner.build_prefill(items, locs, return_all_logits=True, verify=True)
        outs.append(graphs.verify(batch))
    assert outs[0][0].shape[0] == sum(lens)
    for a, b in zip(outs[0], outs[1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(pools(eager), pools(fast), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("drafts", [2, 4])
def test_mtp_plan_equals_the_eager_head_bit_for_bit(super_ckpt, drafts):
    """Nemotron 3 Super's MTP head through its plan (`CpuDecodePlan.for_mtp`: its attention and
    latent-MoE blocks, its output norm): an extend pass of drafts and drafts + 1 rows, then a
    decode pass, give the eager head's logits and outputs and the same KV, bit for bit."""
    hidden_size = preset_config("tiny-nemotron-3-super")["hidden_size"]
    gen = torch.Generator().manual_seed(1)
    lens = [drafts, drafts + 1]
    hidden = torch.randn(sum(lens), hidden_size, generator=gen)
    h2 = torch.randn(len(lens), hidden_size, generator=gen)
    outs, kvs = [], []
    for planned in (False, True):
        model = load_model(super_ckpt, dtype="float32", mtp=True)
        runner = ModelRunner(model, RunnerConfig(max_running_requests=4))
        plan = CpuDecodePlan.for_mtp(model) if planned else None
        rows = [(runner.req_pool.alloc(1)[0], n) for n in lens]
        items = [ExtendInput(q, 0, 0, list(range(7, 7 + n))) for q, n in rows]
        locs = [runner.alloc_kv(q, 0, n + 1) for q, n in rows]
        heads = [loc[:n] for loc, (_, n) in zip(locs, rows, strict=True)]
        tails = [loc[n:] for loc, (_, n) in zip(locs, rows, strict=True)]
        batch = runner.build_prefill(items, heads)
        dec = runner.build_decode([DecodeInput(q, 0, n, 3) for q, n in rows], torch.cat(tails))
        if planned:
            assert plan is not None and plan.verifies
            with torch.inference_mode():
                x1 = model.mtp.layer_input(batch.input_ids, hidden, model.embed_tokens)
                x2 = model.mtp.layer_input(dec.input_ids, h2, model.embed_tokens)
            outs.append((*plan.verify(batch, x1), *plan.verify(dec, x2)))
        else:
            y1, y2 = model.mtp_hidden(batch, hidden), model.mtp_hidden(dec, h2)
            outs.append((model.draft_logits(y1), y1, model.draft_logits(y2), y2))
        kvs.append(runner.kv_pool.k_all[-1].clone())
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kvs[0], kvs[1])
    assert kvs[0].abs().sum() > 0  # the head wrote its own KV layer


def test_where_the_plan_does_not_apply(ckpt, kernels_mode):
    runner, _, _ = prefilled(ckpt)
    model = runner.model
    args = (runner.kv_pool, runner.mamba_pool, runner.req_pool.req_to_token)
    assert plan_refusal.unsupported(model) is None
    proj = model.backbone.layers[0].mixer.out_proj
    proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features))
    assert plan_refusal.unsupported(model) == "a bias (backbone.layers.0.mixer.out_proj.bias)"
    proj.bias = None
    assert isinstance(CpuDecodePlan.build(model, *args), CpuDecodePlan)
    kernels_mode("torch", model)
    assert CpuDecodePlan.build(model, *args) is None
