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
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import ExtendInput
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
