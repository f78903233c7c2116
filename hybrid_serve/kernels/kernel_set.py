"""Which implementation runs each op: chosen once, when a model is built, from the device, the
activations' dtype, what this machine can run and `KernelSettings`; then fixed.

The model's layers receive a `KernelSet` at construction and call its fields; nothing decides
per call which implementation runs. `choose` builds one of three sets:

- `triton` (CUDA tensors, or CPU tensors in triton's interpreter): the Triton kernels for the
  conv, the gated delta rule, Mamba2's chunked scan and state update, attention, the gated
  norms and the routed experts, and the block GEMM for resident block-FP8 matrices
  (`hybrid_serve.kernels.fp8`); torch for the other dense products;
- `cpp` (CPU tensors, fp32 activations, the C++ kernels built): the C++ kernels for every op
  that has one, and the fused decode blocks; with bf16 products at batch (`bf16_products`: bf16
  matrices multiplied in bf16 at every row count, `kernels.cpp_ops`) where the CPU multiplies
  bf16 in hardware, unless `KernelSettings.bf16_products` says otherwise;
- `torch`: the pure-torch references, which call only references.

A fused op that a set does not have is the reference composition of that set's unfused ops
(`functools.partial` over the reference's sub-op arguments, `assemble`), so every set has every
field.
`table` is the start-up log's one-line-per-op summary.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial
from types import ModuleType

import torch

from hybrid_serve.kernels import (
    attention,
    attn_step,
    causal_conv1d,
    cpp_build,
    cpu_levels,
    experts,
    gated_delta_rule,
    gdn_step,
    linear,
    mamba2_step,
    moe_step,
    multi_linear,
    relu2_moe,
    rmsnorm,
    selective_state_update,
    ssd,
)
from hybrid_serve.kernels.settings import CPU_LEVEL_ENV, KERNELS_ENV, KernelSettings
from hybrid_serve.kernels.slow_paths import warn_once

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSet:
    """One implementation per op; every implementation keeps its reference's signature and
    contract (the reference modules' docstrings)."""

    backend: str  # "triton", "cpp" or "torch"
    fused: bool  # whether the fused decode ops are the backend's own kernels
    linear: Callable
    linear_multi: Callable
    rms_norm: Callable
    fused_add_rmsnorm: Callable
    rms_norm_gated: Callable
    causal_conv1d_fn: Callable
    causal_conv1d_update: Callable
    chunk_gated_delta_rule: Callable
    fused_recurrent_gated_delta_rule: Callable
    extend_attention: Callable
    decode_attention: Callable
    store_kv: Callable
    gdn_decode: Callable
    gdn_verify: Callable
    kda_decode: Callable  # Kimi Delta Attention's (`gdn_step.gdn_decode` with KDA's gate, norm)
    attn_decode: Callable
    sparse_moe: Callable
    fused_experts: Callable
    # Mamba2 hybrids
    rms_norm_plain: Callable
    rms_norm_gate_first: Callable
    mamba_chunk_scan_combined: Callable
    selective_state_update: Callable
    mamba2_decode: Callable
    mamba2_verify: Callable
    relu2_moe: Callable
    state_dtype: torch.dtype = torch.float32  # the recurrent states the recurrent ops take
    bf16_products: bool = False  # the products' bf16 route at batch (C++ set: kernels.cpp_ops)

    def table(self) -> str:
        """One line per op: its name and the function that runs it, after a line naming the
        backend and, for the C++ kernels, their CPU level and whether bf16 products run at
        batch."""
        bf16 = f", bf16 products {'on' if self.bf16_products else 'off'}"
        rows = [
            f"kernels: {self.backend} backend{self.level_note()}, "
            f"fused decode ops {'on' if self.fused else 'off'}"
            f"{bf16 if self.backend == 'cpp' else ''}"
        ]
        for name in op_names():
            rows.append(f"  {name:<34}{describe(getattr(self, name))}")
        return "\n".join(rows)

    def level_note(self) -> str:
        level = cpp_build.loaded_level() if self.backend == "cpp" else None
        return "" if level is None else f" at CPU level {level.name} ({level.features})"

    def info(self) -> dict[str, object]:
        """What /server_info reports of the kernels."""
        level = cpp_build.loaded_level() if self.backend == "cpp" else None
        return {
            "backend": self.backend,
            "fused_decode_ops": self.fused,
            "cpu_level": None if level is None else level.name,
            "cpu_features": None if level is None else level.features,
            "bf16_products": self.bf16_products,
        }


def op_names() -> list[str]:
    """The ops of a `KernelSet` (its Callable fields), in order."""
    return [f.name for f in fields(KernelSet) if f.type == "Callable"]


def describe(fn: object) -> str:
    """How `table` names an op: a function as `module.qualname` (less `hybrid_serve.kernels.`), a
    `functools.partial` as its function followed by what it binds (`name=` and its description
    for a keyword), and any other value, such as a flag, as its repr."""
    if isinstance(fn, partial):
        bound = [describe(a) for a in fn.args]
        bound += [f"{k}={describe(v)}" for k, v in fn.keywords.items()]
        return f"{describe(fn.func)}({', '.join(bound)})"
    name = getattr(fn, "__qualname__", None)
    if not callable(fn) or name is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module.removeprefix('hybrid_serve.kernels.')}.{name}" if module else name


def assemble(
    backend: str,
    linear_fn: Callable,
    rms_norm_fn: Callable,
    rms_norm_gated_fn: Callable,
    conv: ModuleType,
    gdr: ModuleType,
    attn: ModuleType,
    fused_experts: Callable,
    scan: ModuleType = ssd,
    state_update: ModuleType = selective_state_update,
    norm_gate_first: Callable = rmsnorm.rms_norm_gate_first,
) -> KernelSet:
    """A set of these unfused ops (`conv`, `gdr`, `attn`, `scan`, `state_update`: modules with
    the references' function names), its fused ops the reference compositions of them."""
    gdn_decode = partial(
        gdn_step.gdn_decode,
        conv_update=conv.causal_conv1d_update,
        recurrent=gdr.fused_recurrent_gated_delta_rule,
        norm_gated=rms_norm_gated_fn,
    )
    mamba2_decode = partial(
        mamba2_step.mamba2_decode,
        conv_update=conv.causal_conv1d_update,
        state_update=state_update.selective_state_update,
        norm_gate_first=norm_gate_first,
    )
    return KernelSet(
        backend=backend,
        fused=False,
        linear=linear_fn,
        rms_norm=rms_norm_fn,
        rms_norm_gated=rms_norm_gated_fn,
        causal_conv1d_fn=conv.causal_conv1d_fn,
        causal_conv1d_update=conv.causal_conv1d_update,
        chunk_gated_delta_rule=gdr.chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule=gdr.fused_recurrent_gated_delta_rule,
        extend_attention=attn.extend_attention,
        decode_attention=attn.decode_attention,
        store_kv=attn.store_kv,
        linear_multi=partial(multi_linear.linear_multi, linear=linear_fn),
        fused_add_rmsnorm=partial(rmsnorm.fused_add_rmsnorm, rms_norm=rms_norm_fn),
        gdn_decode=gdn_decode,
        gdn_verify=partial(gdn_step.gdn_verify, decode=gdn_decode),
        kda_decode=partial(gdn_decode, norm_gated=rmsnorm.rms_norm_gated_sigmoid),
        attn_decode=partial(
            attn_step.attn_decode,
            rms_norm=rms_norm_fn,
            store_kv=attn.store_kv,
            decode_attention=attn.decode_attention,
        ),
        sparse_moe=partial(moe_step.sparse_moe, linear=linear_fn, fused_experts=fused_experts),
        fused_experts=fused_experts,
        rms_norm_plain=rmsnorm.rms_norm_plain,
        rms_norm_gate_first=norm_gate_first,
        mamba_chunk_scan_combined=scan.mamba_chunk_scan_combined,
        selective_state_update=state_update.selective_state_update,
        mamba2_decode=mamba2_decode,
        mamba2_verify=partial(mamba2_step.mamba2_verify, decode=mamba2_decode),
        relu2_moe=partial(relu2_moe.relu2_moe, linear=linear_fn),
    )


def reference_set() -> KernelSet:
    """The pure-torch references (any device, any dtype)."""
    return assemble(
        "torch", linear.linear, rmsnorm.rms_norm, rmsnorm.rms_norm_gated, causal_conv1d,
        gated_delta_rule, attention, partial(experts.fused_experts, routed=experts.routed_experts),
    )  # fmt: skip


def triton_set(device: torch.device) -> KernelSet:
    """Triton for the conv, the delta rule, Mamba2's chunked scan and state update, attention,
    the gated norms, the routed experts (grouped GEMMs over expert-sorted blocks, static shapes:
    `fused_moe_triton`) and the products of block-FP8 matrices (`fp8_gemm_triton.linear`,
    torch's for the others); torch elsewhere."""
    norm = triton_module("rmsnorm_triton", device)
    return assemble(
        "triton", triton_module("fp8_gemm_triton", device).linear, rmsnorm.rms_norm,
        norm.rms_norm_gated,
        triton_module("causal_conv1d_triton", device),
        triton_module("gated_delta_rule_triton", device),
        triton_module("attention_triton", device),
        triton_module("fused_moe_triton", device).fused_experts,
        triton_module("ssd_triton", device),
        triton_module("selective_state_update_triton", device), norm.rms_norm_gate_first,
    )  # fmt: skip


def cpp_set(fusions: bool, bf16_products: bool = False) -> KernelSet:
    """The C++ CPU kernels (`kernels.cpp_ops`, `kernels.cpp_fused`; their load-time contract:
    fp32 activations, C++ weight formats, fp32 states); with `fusions`, the fused decode ops'
    own C++ kernels in place of the compositions (the residual-add norm and the plain norm
    among them, as `HYBRID_SERVE_FUSIONS` switches them); with `bf16_products`, the products'
    bf16 route at batch: `cpp_ops.linear`, `linear_multi`, `routed_experts` and
    `cpp_fused.sparse_moe` with their keyword `bf16_products=True` bound (without it, those
    functions themselves). Under the route the loader packs every bf16 matrix in K-pair panels
    (`models.loader.pack_matrices`, `kernels.bf16_pack`), which those products then read."""
    from hybrid_serve.kernels import cpp_fused, cpp_ops

    def routed(fn: Callable, **bound: object) -> Callable:
        if bf16_products:
            bound["bf16_products"] = True
        return partial(fn, **bound) if bound else fn

    linear_fn = routed(cpp_ops.linear)
    unfused = assemble(
        "cpp", linear_fn, cpp_ops.rms_norm if fusions else rmsnorm.rms_norm,
        cpp_ops.rms_norm_gated, cpp_ops, cpp_ops, attention,
        partial(experts.fused_experts, routed=routed(cpp_ops.routed_experts)),
    )  # fmt: skip
    unfused = replace(unfused, bf16_products=bf16_products)
    if not fusions:
        return unfused
    return replace(
        unfused,
        fused=True,
        linear_multi=routed(cpp_ops.linear_multi),
        fused_add_rmsnorm=cpp_ops.fused_add_rmsnorm,
        gdn_decode=cpp_fused.gdn_decode,
        gdn_verify=cpp_fused.gdn_verify,
        kda_decode=cpp_fused.kda_decode,
        attn_decode=cpp_fused.attn_decode,
        mamba2_decode=cpp_fused.mamba2_decode,
        mamba2_verify=cpp_fused.mamba2_verify,
        sparse_moe=routed(cpp_fused.sparse_moe, unfused=unfused.sparse_moe),
    )


RECURRENT = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gdn_decode",
             "gdn_verify", "kda_decode", "mamba2_decode", "mamba2_verify")  # fmt: skip


def choose(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    settings: KernelSettings | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> KernelSet:
    """The kernel set for a model whose activations are `dtype` on `device` and whose recurrent
    states are `state_dtype` (see the module docstring). The C++ kernels read and write fp32
    states in place: with other states the C++ set takes the references' recurrent ops
    (`RECURRENT`). `settings` default to the environment's.

    Every choice that leaves kernels this code has for the torch references logs one WARNING
    per process (`slow_paths.warn_once`) naming the ops, the reason and the setting that avoids
    it: CUDA without triton, CPU activations other than fp32, `cpp` asked for where it does not
    apply, a scalar CPU level (`vector_level`), states other than fp32 on the C++ set. A build
    that failed raises (`cpp_ready`); no compiler is `cpp_build`'s one WARNING."""
    settings = settings or KernelSettings.from_env()
    device = torch.device(device)
    backend = settings.backend
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if backend == "auto":
        if device.type == "cuda":
            backend = "triton" if triton_available() else "torch"
            if backend == "torch":
                why = _import_error[0] if _import_error else "unavailable"
                warn_once(logger, "no-triton", NO_TRITON, why)
        elif device.type == "cpu" and not cpu_fp32:
            warn_once(logger, f"cpu-activations-{dtype}", CPU_ACTIVATIONS, _name(dtype))
            backend = "torch"
        else:
            ready = cpu_fp32 and cpp_ready(settings) and vector_level(settings)
            backend = "cpp" if ready else "torch"
    if backend == "triton":
        return replace(triton_set(device), state_dtype=state_dtype)
    if backend == "cpp" and not cpu_fp32:
        warn_once(logger, f"cpp-off-cpu-{device.type}-{dtype}", CPP_ELSEWHERE, KERNELS_ENV,
                  _name(dtype), device.type)  # fmt: skip
    if backend == "cpp" and cpu_fp32:
        if not cpp_ready(settings):
            raise RuntimeError(f"{KERNELS_ENV}=cpp but the C++ kernels cannot be built") from (
                cpp_build.load_error()
            )
        ops = cpp_set(settings.fusions, bf16_products(settings))
        if state_dtype != torch.float32:
            warn_once(logger, f"recurrent-states-{state_dtype}", REFERENCE_RECURRENT,
                      _name(state_dtype), ", ".join(RECURRENT))  # fmt: skip
            ref = reference_set()
            ops = replace(ops, **{name: getattr(ref, name) for name in RECURRENT})
        return replace(ops, state_dtype=state_dtype)
    return replace(reference_set(), state_dtype=state_dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The WARNINGs of `choose` (one per process each: `slow_paths.warn_once`).
NO_TRITON = (
    "triton cannot be imported (%s): every op of a CUDA model runs the torch references, which "
    "are slower and capture no CUDA graphs; install triton (pip install -e '.[gpu]') to run the "
    "Triton kernels"
)
CPU_ACTIVATIONS = (
    "%s activations on the CPU: the C++ kernels take fp32 activations, so every op runs the "
    "torch references, which are slower, and there is no CPU decode plan; --dtype float32, or "
    "--dtype bfloat16 (bf16 weights, fp32 activations), runs the C++ kernels"
)
CPP_ELSEWHERE = (
    "%s=cpp, but the C++ kernels take fp32 activations on the CPU, not %s on %s: every op runs "
    "the torch references, which are slower; on CUDA, auto takes the Triton kernels, and on the "
    "CPU --dtype float32 or bfloat16 (fp32 activations) runs the C++ kernels"
)
REFERENCE_RECURRENT = (
    "%s recurrent states (--mamba-ssm-dtype, else the checkpoint's config): the C++ recurrent "
    "kernels read and write fp32 states in place, so %s run the torch references, which are "
    "slower, and there is no CPU decode plan; --mamba-ssm-dtype float32 keeps them on the C++ "
    "kernels"
)
SCALAR_LEVEL = (
    "CPU level %s has no vector bodies (%s): the C++ kernels' scalar products are slower than "
    "torch's own matmuls, so every op runs the torch references and there is no CPU decode "
    "plan; %s"
)


def bf16_products(settings: KernelSettings) -> bool:
    """Whether the C++ set takes the bf16 route at batch: `KernelSettings.bf16_products` `on`,
    or `auto` on a CPU that multiplies bf16 in hardware (`cpu_levels.multiplies_bf16`: there
    the bf16 dots outrun the widening fp32 GEMV and GEMM: gemm_shapes.py)."""
    if settings.bf16_products == "auto":
        return cpu_levels.multiplies_bf16()
    return settings.bf16_products == "on"


def vector_level(settings: KernelSettings) -> bool:
    """Whether the loaded C++ level has vector bodies. At x86's generic level (no AVX2) torch's
    own matmuls, which dispatch to the SSE the CPU has, outrun our scalar products many times
    over at 8 rows and more (BENCHMARKS.md, "CPU levels"), so `auto` takes the torch set there,
    with one WARNING per process (`SCALAR_LEVEL`); `HYBRID_SERVE_KERNELS=cpp` still forces the
    C++ one."""
    level = cpp_build.loaded_level()
    if level is None or level.vector:
        return True
    if settings.cpu_level == level.name:
        why, avoid = f"{CPU_LEVEL_ENV}={level.name}", f"{CPU_LEVEL_ENV}=auto takes the best level"
    else:
        why, avoid = "this CPU has no AVX2 + FMA", f"{KERNELS_ENV}=cpp forces the scalar kernels"
    warn_once(logger, "scalar-level", SCALAR_LEVEL, level.name, why, avoid)
    return False


def cpp_ready(settings: KernelSettings) -> bool:
    """Whether the C++ kernels are loaded at the settings' CPU level. False where this machine
    has no compiler (`cpp_build` warned once); a build that failed with a compiler present
    raises: the server does not start on the references unless asked to
    (`HYBRID_SERVE_KERNELS=torch`)."""
    if cpp_build.load(settings.cpu_level, settings) is not None:
        return True
    err = cpp_build.load_error()
    if isinstance(err, cpp_build.BuildError):
        raise RuntimeError(
            f"{err} (set {KERNELS_ENV}=torch to serve on the torch references instead)"
        ) from err
    return False


_import_error: list[BaseException] = []  # the first failure importing triton, if any


def triton_available() -> bool:
    """True when `import triton` succeeds (tried once per process)."""
    if _import_error:
        return False
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install can raise more than ImportError
        _import_error.append(e)  # `choose` warns where CUDA loses the Triton kernels
        return False
    return True


def interpreter_ready() -> bool:
    """True when triton was imported in interpreter mode (its own helpers such as `tl.sum` are
    then interpreted functions), so kernels can run on CPU tensors."""
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def triton_module(name: str, device: torch.device) -> ModuleType:
    """Import `hybrid_serve.kernels.<name>` (a Triton module) for use on `device`: on a device
    other than CUDA in triton's interpreter, which must be chosen before triton is first
    imported (this sets TRITON_INTERPRET=1 if nothing imported triton yet, and raises
    RuntimeError if it was imported for the GPU). Every Triton module records in `INTERPRETED`
    whether its kernels were defined for the interpreter."""
    interpret = device.type != "cuda"
    full_name = f"hybrid_serve.kernels.{name}"
    if interpret and full_name not in sys.modules:
        if "triton" in sys.modules and not interpreter_ready():
            raise RuntimeError(_NO_INTERPRETER.format(device=device))
        os.environ["TRITON_INTERPRET"] = "1"  # our kernels are defined at import
    if not triton_available():
        raise ImportError("triton cannot be imported") from _import_error[0]
    module = importlib.import_module(full_name)
    if interpret and not (module.INTERPRETED and interpreter_ready()):
        raise RuntimeError(_NO_INTERPRETER.format(device=device))
    return module


_NO_INTERPRETER = (
    "Triton kernels on {device} tensors need triton's interpreter, but triton (or the kernel "
    "module) was imported without TRITON_INTERPRET=1; set it before anything imports triton"
)
