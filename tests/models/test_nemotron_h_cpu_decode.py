"""NemotronH's CPU decode plan (`models.cpu_decode.CpuDecodePlan`): bit for bit the eager
decode step, logits and pools (conv and SSM states, KV), on the tiny preset (every block kind)
and a variant without the conv bias and with a clamping dt limit; and where it does not apply."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models import plan_refusal
from hybrid_serve.models.cpu_decode import CpuDecodePlan
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)
from tests.models import plan_harness
from tests.models.plan_harness import assert_steps_alike

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
