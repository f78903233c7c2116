"""Which implementation each op runs: `kernels.choose` by device, dtype, what builds and the
settings (`HYBRID_SERVE_KERNELS`, `HYBRID_SERVE_FUSIONS`), decided once per model."""

from __future__ import annotations

import logging
import subprocess
import sys
from functools import partial

import pytest
import torch

from hybrid_serve.kernels import (
    KernelSet,
    KernelSettings,
    choose,
    cpu_levels,
    kernel_set,
    multi_linear,
    reference_set,
    rmsnorm,
)
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model

OPS = kernel_set.op_names()


def functions(fn) -> list:
    """`fn` and, for a composition, every sub-op it was given (recursively; a bound flag such
    as `bf16_products=True` is no sub-op)."""
    if isinstance(fn, partial):
        subs = [sub for sub in fn.keywords.values() if callable(sub)]
        return [fn.func, *(g for sub in subs for g in functions(sub))]
    return [fn]


def is_op(fn, op, route: bool, **more) -> bool:
    """Whether a set's `fn` is `op`: `op` itself when it binds nothing, else a partial of `op`
    binding exactly `more` and, with the bf16 route, `bf16_products=True`."""
    keywords = {**more, "bf16_products": True} if route else more
    if not keywords:
        return fn is op
    return isinstance(fn, partial) and fn.func is op and not fn.args and fn.keywords == keywords


def modules(ops: KernelSet) -> set[str]:
    return {g.__module__ for name in OPS for g in functions(getattr(ops, name))}


def test_settings_from_the_environment() -> None:
    assert KernelSettings.from_env({}) == KernelSettings("auto", True)
    env = {"HYBRID_SERVE_KERNELS": " Torch ", "HYBRID_SERVE_FUSIONS": "off"}
    assert KernelSettings.from_env(env) == KernelSettings("torch", False)
    with pytest.raises(ValueError, match="HYBRID_SERVE_KERNELS='cuda'"):
        KernelSettings.from_env({"HYBRID_SERVE_KERNELS": "cuda"})
    with pytest.raises(ValueError, match="HYBRID_SERVE_FUSIONS"):
        KernelSettings.from_env({"HYBRID_SERVE_FUSIONS": "sideways"})
    assert KernelSettings.from_env({}).bf16_products == "auto"
    assert KernelSettings.from_env({"HYBRID_SERVE_BF16_PRODUCTS": "Off "}).bf16_products == "off"
    with pytest.raises(ValueError, match="HYBRID_SERVE_BF16_PRODUCTS='yes'"):
        KernelSettings.from_env({"HYBRID_SERVE_BF16_PRODUCTS": "yes"})


def test_references_call_only_references() -> None:
    """Every op of the torch set, and every sub-op its compositions were given, is a pure-torch
    reference (no C++ or Triton module anywhere in it)."""
    ops = choose("cpu", settings=KernelSettings("torch"))
    assert ops.backend == "torch" and not ops.fused
    assert not any(
        m.endswith("_triton") or m.startswith("hybrid_serve.kernels.cpp_") for m in modules(ops)
    )
    assert modules(ops) == modules(reference_set())


@pytest.mark.parametrize("backend", ["auto", "cpp"])
def test_cpu_fp32_takes_the_cpp_kernels(monkeypatch, backend) -> None:
    monkeypatch.setattr(kernel_set, "cpp_ready", lambda settings: True)
    ops = choose("cpu", torch.float32, KernelSettings(backend))
    assert ops.backend == "cpp" and ops.fused
    assert functions(ops.linear)[0].__module__ == "hybrid_serve.kernels.cpp_ops"
    assert ops.gdn_decode.__module__ == "hybrid_serve.kernels.cpp_fused"
    assert (
        ops.mamba2_decode.__module__
        == ops.mamba2_verify.__module__
        == "hybrid_serve.kernels.cpp_fused"
    )
    assert not any(m.endswith("_triton") for m in modules(ops))


def test_fusions_off_composes_the_unfused_cpp_kernels(monkeypatch) -> None:
    """Without fusions the fused ops are the references' compositions of the C++ unfused
    kernels: the same kernels otherwise."""
    monkeypatch.setattr(kernel_set, "cpp_ready", lambda settings: True)
    ops = choose("cpu", settings=KernelSettings("cpp", fusions=False))
    assert ops.backend == "cpp" and not ops.fused
    assert ops.gdn_decode.func.__module__ == "hybrid_serve.kernels.gdn_step"
    assert ops.gdn_decode.keywords["recurrent"].__module__ == "hybrid_serve.kernels.cpp_ops"
    assert ops.fused_add_rmsnorm.func is rmsnorm.fused_add_rmsnorm
    assert ops.mamba2_decode.func.__module__ == "hybrid_serve.kernels.mamba2_step"
    assert functions(ops.linear)[0].__module__ == "hybrid_serve.kernels.cpp_ops"


def messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_where_the_cpp_kernels_do_not_apply(monkeypatch, slow_path_warnings, caplog) -> None:
    """bf16 or fp16 activations on the CPU take the references, with one WARNING per process
    and dtype naming the --dtype that keeps the C++ kernels; fp32 activations, which take them,
    log none (a failed build or no compiler: tests/kernels/test_cpp_build.py)."""
    from hybrid_serve.kernels import cpp_build

    monkeypatch.setattr(kernel_set, "cpp_ready", lambda settings: True)
    monkeypatch.setattr(cpp_build, "loaded_level", lambda: cpu_levels.get("x86-64-v3", "x86_64"))
    assert choose("cpu", torch.float32, KernelSettings()).backend == "cpp"
    assert slow_path_warnings("") == 0
    for _ in range(2):
        assert choose("cpu", torch.bfloat16, KernelSettings()).backend == "torch"
        assert choose("cpu", torch.float16, KernelSettings()).backend == "torch"
    assert slow_path_warnings("activations on the CPU") == 2
    texts = messages(caplog, "activations on the CPU")
    assert sorted(t.split()[0] for t in texts) == ["bfloat16", "float16"]
    assert all("torch references" in t and "--dtype float32" in t for t in texts)


def test_cpp_asked_for_where_it_does_not_apply_warns_once(slow_path_warnings, caplog) -> None:
    """HYBRID_SERVE_KERNELS=cpp on a CUDA device or with bf16 CPU activations: the references
    serve, and one WARNING says so and what runs the fast kernels there."""
    for _ in range(2):
        assert choose("cuda", torch.bfloat16, KernelSettings("cpp")).backend == "torch"
    assert slow_path_warnings("HYBRID_SERVE_KERNELS=cpp") == 1
    (text,) = messages(caplog, "HYBRID_SERVE_KERNELS=cpp")
    assert "not bfloat16 on cuda" in text and "auto takes the Triton kernels" in text


def test_cuda_without_triton_takes_torch(monkeypatch, slow_path_warnings, caplog) -> None:
    """One WARNING per process names the import error and what to install; CUDA with triton
    logs none."""
    monkeypatch.setattr(kernel_set, "triton_available", lambda: True)
    monkeypatch.setattr(kernel_set, "triton_set", lambda device: reference_set())
    choose("cuda", torch.bfloat16, KernelSettings())
    assert slow_path_warnings("") == 0
    monkeypatch.setattr(kernel_set, "triton_available", lambda: False)
    monkeypatch.setattr(kernel_set, "_import_error", [ImportError("No module named 'triton'")])
    for _ in range(2):
        assert choose("cuda", torch.bfloat16, KernelSettings()).backend == "torch"
    assert slow_path_warnings("triton cannot be imported") == 1
    (text,) = messages(caplog, "triton cannot be imported")
    assert "No module named 'triton'" in text and "install triton" in text


def test_states_other_than_fp32_take_the_reference_recurrent_ops_and_say_so(
    monkeypatch, slow_path_warnings, caplog
) -> None:
    """bf16 recurrent states on the C++ set (`--mamba-ssm-dtype bfloat16`): the recurrent ops
    are the references', and one WARNING per process names them and the flag that keeps them
    on the C++ kernels; fp32 states, and the torch set whatever its states, log none."""
    monkeypatch.setattr(kernel_set, "cpp_ready", lambda settings: True)
    fast = choose("cpu", settings=KernelSettings("cpp"))
    choose("cpu", settings=KernelSettings("torch"), state_dtype=torch.bfloat16)
    assert slow_path_warnings("") == 0
    for _ in range(2):
        ops = choose("cpu", settings=KernelSettings("cpp"), state_dtype=torch.bfloat16)
    for name in kernel_set.RECURRENT:
        assert getattr(ops, name) is not getattr(fast, name)
    assert slow_path_warnings("recurrent states") == 1
    (text,) = messages(caplog, "recurrent states")
    assert text.startswith("bfloat16 recurrent states") and "--mamba-ssm-dtype float32" in text
    assert all(name in text for name in kernel_set.RECURRENT)


def test_forced_triton_on_cpu_runs_the_interpreter(triton_device) -> None:
    ops = choose(triton_device, settings=KernelSettings("triton"))
    assert (
        ops.backend == "triton"
        and ops.rms_norm_gated.__module__ == "hybrid_serve.kernels.rmsnorm_triton"
    )
    assert ops.mamba_chunk_scan_combined.__module__ == "hybrid_serve.kernels.ssd_triton"
    assert (
        ops.selective_state_update.__module__
        == "hybrid_serve.kernels.selective_state_update_triton"
    )
    args = (torch.randn(3, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    args = [a.to(triton_device) if isinstance(a, torch.Tensor) else a for a in args]
    torch.testing.assert_close(
        ops.rms_norm_gated(*args), rmsnorm.rms_norm_gated(*args), atol=1e-5, rtol=1e-5
    )


def test_the_loader_logs_the_table_and_the_layers_hold_the_set(tmp_path, caplog) -> None:
    ckpt = write_checkpoint(tmp_path, preset_config("tiny"), seed=1)
    with caplog.at_level(logging.INFO, logger="hybrid_serve.models.loader"):
        model = load_model(ckpt, dtype="float32")
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:"))
    assert all(f"  {name} " in table for name in OPS)
    holders = [m for m in model.modules() if hasattr(m, "ops")]
    assert len(holders) > 10 and all(m.ops is model.ops for m in holders)
    torch_ops = choose("cpu", settings=KernelSettings("torch"))
    model.use_kernels(torch_ops)
    assert all(m.ops is torch_ops for m in holders)


def test_importing_the_model_does_not_import_triton() -> None:
    code = (
        "import sys, hybrid_serve.kernels, hybrid_serve.models.qwen3_next\n"
        "import hybrid_serve.mem_cache.kv_pool\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_level_without_vector_bodies_takes_torchs_matmuls(
    monkeypatch, slow_path_warnings, caplog
) -> None:
    """x86's generic level runs simd.h's scalar bodies: `auto` takes the torch set there, with
    one WARNING per process that says what to set (the level loaded, never the host's), `cpp`
    still forces the C++ one; a vector level logs none."""
    from hybrid_serve.kernels import cpp_build, slow_paths

    best = cpu_levels.get("x86-64-v3", "x86_64")
    monkeypatch.setattr(kernel_set, "cpp_ready", lambda settings: True)
    monkeypatch.setattr(cpp_build, "loaded_level", lambda: best)
    assert choose("cpu", torch.float32, KernelSettings()).backend == "cpp"
    assert slow_path_warnings("") == 0
    generic = cpu_levels.get("generic", "x86_64")
    monkeypatch.setattr(cpp_build, "loaded_level", lambda: generic)
    for _ in range(2):
        assert choose("cpu", torch.float32, KernelSettings()).backend == "torch"
    assert choose("cpu", torch.float32, KernelSettings("cpp")).backend == "cpp"
    assert slow_path_warnings("no vector bodies") == 1
    (text,) = messages(caplog, "no vector bodies")
    assert "this CPU has no AVX2 + FMA" in text and "HYBRID_SERVE_KERNELS=cpp" in text
    slow_paths._seen.clear()  # a new process, which asked for the generic level by name
    choose("cpu", torch.float32, KernelSettings(cpu_level="generic"))
    assert slow_path_warnings("no vector bodies") == 2
    assert "HYBRID_SERVE_CPU_LEVEL=auto" in messages(caplog, "no vector bodies")[-1]


@pytest.mark.parametrize(
    ("setting", "features", "route"),
    [
        ("auto", {"avx512f", "avx512_bf16"}, True),  # Zen 4, Cooper Lake
        ("auto", {"avx512f", "amx_tile", "amx_bf16"}, True),
        ("auto", {"avx2", "fma", "avx512f", "avx512_vnni"}, False),  # no bf16 dot products
        ("auto", {"asimd", "asimddp"}, False),
        ("off", {"avx512_bf16", "amx_bf16"}, False),
        ("on", {"avx2", "fma"}, True),
    ],
)
def test_bf16_products_by_cpu_features_and_setting(monkeypatch, setting, features, route) -> None:
    """The C++ set takes the bf16 route at batch on a CPU with avx512_bf16 or AMX (the
    features faked here, never the host's), or where the settings force it; everywhere else
    every product is the exact one, the same functions as without the route. The torch
    references never take it."""
    from hybrid_serve.kernels import cpp_fused, cpp_ops

    monkeypatch.setattr(kernel_set, "cpp_ready", lambda settings: True)
    monkeypatch.setattr(cpu_levels, "host_features", lambda cpuinfo=None: frozenset(features))
    for fusions in (True, False):
        ops = choose("cpu", torch.float32, KernelSettings("cpp", fusions, bf16_products=setting))
        assert ops.bf16_products is route
        assert is_op(ops.linear, cpp_ops.linear, route)
        if fusions:
            unfused = ops.sparse_moe.keywords["unfused"]
            assert is_op(ops.linear_multi, cpp_ops.linear_multi, route)
            assert is_op(ops.sparse_moe, cpp_fused.sparse_moe, route, unfused=unfused)
            assert unfused.keywords["linear"] is ops.linear
        else:
            assert ops.linear_multi.func is multi_linear.linear_multi
            assert ops.linear_multi.keywords["linear"] is ops.linear
            assert ops.sparse_moe.keywords["linear"] is ops.linear
        table = ops.table()
        assert table.splitlines()[0].endswith(f"bf16 products {'on' if route else 'off'}")
        assert ("cpp_ops.linear(bf16_products=True)" in table) is route
        assert ops.info()["bf16_products"] is route
    torch_ops = choose("cpu", settings=KernelSettings("torch", bf16_products=setting))
    assert (
        not torch_ops.bf16_products and torch_ops.linear.__module__ == "hybrid_serve.kernels.linear"
    )


def test_the_table_names_functions_and_the_values_partials_bind() -> None:
    """`describe`, the table's column: a function as module.qualname, a partial as its function
    and what it binds (nested partials likewise), a bound flag, size or name as name=value."""
    from hybrid_serve.kernels import cpp_ops

    describe = kernel_set.describe
    assert describe(rmsnorm.rms_norm) == "rmsnorm.rms_norm"
    assert describe(KernelSet.table) == "kernel_set.KernelSet.table"
    routed = partial(multi_linear.linear_multi, linear=partial(cpp_ops.linear, bf16_products=True))
    want = "multi_linear.linear_multi(linear=cpp_ops.linear(bf16_products=True))"
    assert describe(routed) == want
    bound = partial(rmsnorm.rms_norm, 8, eps=1e-6, mode="rows")
    assert describe(bound) == "rmsnorm.rms_norm(8, eps=1e-06, mode='rows')"
