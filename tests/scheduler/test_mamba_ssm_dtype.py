"""`--mamba-ssm-dtype` (SGLang's flag): the dtype of the Mamba pool's temporal states, else the
checkpoint's `mamba_ssm_dtype` / `mamba_ssm_cache_dtype`, else fp32. bf16 states halve the
temporal bytes of a slot (the start-up line says so), keep the model close to fp32 states
(teacher-forced KL and top-1 agreement through chunked prefill and decode:
`benchmarks/ssm_state_dtype.py`), and serve through the radix cache and the host tier with every
pool clean."""

from __future__ import annotations

import pytest
import torch

from benchmarks.ssm_state_dtype import fidelity
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.model_runner import ModelRunner
from hybrid_serve.scheduler.pool_sizing import describe, pool_bytes
from tests.kernels.cpp_required import require_cpp

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = tmp_path_factory.mktemp("granite")
    write_checkpoint(path, preset_config("tiny-granite-4.0-h"), seed=1)
    return path, load_model(path, dtype="float32")


def test_flag_is_validated():
    with pytest.raises(ValueError, match="--mamba-ssm-dtype must be one of"):
        RunnerConfig(mamba_ssm_dtype="int8")


def test_checkpoint_default_and_the_flag_override(tmp_path):
    config = {**preset_config("tiny-nemotron-h"), "mamba_ssm_cache_dtype": "bfloat16"}
    model = load_model(write_checkpoint(tmp_path, config, seed=1), dtype="float32")
    assert model.config.mamba_ssm_dtype == "bfloat16"
    pool = ModelRunner(model, RunnerConfig(max_running_requests=2)).mamba_pool
    assert pool.ssm_state.dtype == torch.bfloat16 and pool.conv_state.dtype == torch.float32
    flagged = ModelRunner(model, RunnerConfig(max_running_requests=2, mamba_ssm_dtype="float32"))
    assert flagged.mamba_pool.ssm_state.dtype == torch.float32


def test_bf16_states_halve_the_temporal_bytes(granite):
    _, model = granite
    fp32, bf16 = pool_bytes(model, torch.float32), pool_bytes(model, torch.bfloat16)
    temporal = sum(s.temporal[0] * s.temporal[1] * s.temporal[2] for s in model.state_shapes)
    assert fp32.mamba_per_slot - bf16.mamba_per_slot == 2 * temporal
    line = describe(RunnerConfig(max_running_requests=2, max_total_tokens=64), bf16)
    assert "bfloat16 SSM states" in line and "MiB" in line


@pytest.mark.parametrize("preset", ["tiny-granite-4.0-h", "tiny-olmo-hybrid"])
def test_bf16_states_stay_close_to_fp32(preset, granite, tmp_path):
    if preset == "tiny-granite-4.0-h":
        model = granite[1]
    else:
        model = load_model(write_checkpoint(tmp_path, preset_config(preset), seed=1), "float32")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (150, 300)]
    row = fidelity(model, prompts, chunk=100, steps=16, dtype="bfloat16")
    assert row["kl_mean"] < 1e-3 and row["kl_max"] < 1e-2, row
    assert row["top1_agreement"] >= 0.9, row


def test_bf16_states_serve_through_the_cache_and_host_tier(granite):
    path, _ = granite
    engine = Engine(
        str(path),
        mamba_ssm_dtype="bfloat16",
        mamba_scheduler_strategy="extra_buffer",
        enable_hierarchical_cache=True,
        max_running_requests=2,
        max_total_tokens=2048,
        chunked_prefill_size=96,
    )
    runner = engine.scheduler.runner
    assert runner.mamba_pool.ssm_state.dtype == torch.bfloat16
    prompt = torch.randint(3, 2048, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    first = engine.generate(prompt, GREEDY)
    again = engine.generate(prompt, GREEDY)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= len(prompt) - 1
    assert engine.scheduler.tree.host.mamba_pool.ssm_state.dtype == torch.bfloat16
    assert engine.leak_report() == []


def test_bf16_states_take_the_reference_recurrent_ops_on_the_cpp_set(tmp_path, slow_path_warnings):
    """The C++ recurrent ops read and write fp32 states in place: a bf16-state model on the C++
    set runs the references' recurrent ops (the rest stays C++), which start-up says in one
    WARNING per process, and a runner refuses a bf16 pool under a set chosen for fp32 states.
    Where the C++ kernels do not build, the test fails with the build's error."""
    from hybrid_serve.kernels import KernelSettings, choose, reference_set
    from hybrid_serve.kernels.kernel_set import RECURRENT, describe

    require_cpp()
    choose("cpu", settings=KernelSettings("cpp"))
    assert slow_path_warnings("recurrent states") == 0
    ops = choose("cpu", settings=KernelSettings("cpp"), state_dtype=torch.bfloat16)
    choose("cpu", settings=KernelSettings("cpp"), state_dtype=torch.bfloat16)
    assert slow_path_warnings("--mamba-ssm-dtype float32 keeps them on the C++ kernels") == 1
    ref = reference_set()
    assert ops.backend == "cpp" and ops.state_dtype == torch.bfloat16
    for name in RECURRENT:
        assert describe(getattr(ops, name)) == describe(getattr(ref, name)), name
    assert describe(ops.linear) != describe(ref.linear)
    path = write_checkpoint(tmp_path, preset_config("tiny-nemotron-h"), seed=1)
    model = load_model(path, dtype="float32", ops=choose("cpu", settings=KernelSettings("cpp")))
    with pytest.raises(ValueError, match="chosen for torch.float32 recurrent states"):
        ModelRunner(model, RunnerConfig(max_running_requests=2, mamba_ssm_dtype="bfloat16"))
