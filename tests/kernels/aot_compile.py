"""Compile every Triton kernel for a CUDA target on a machine without a GPU.

The interpreter tests check what the kernels compute, not whether triton's GPU compiler accepts
them (type rules of `if` branches, shared-memory limits, ...). This script runs each wrapper on
small CPU tensors with launches intercepted, then compiles every intercepted launch ahead of
time down to a cubin with the ptxas bundled in the triton wheel, and prints each kernel's
shared memory. It takes minutes, so it is not part of the test suite.

    python -m tests.kernels.aot_compile --arch 90 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys

H100_SHARED_LIMIT = 232448  # bytes per block on sm_90 (opt-in maximum)
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64"}
_DTYPES.update({"int32": "i32", "bool": "i1"})


def launches(dtype_name: str) -> list[tuple]:
    """(jit function, args, kwargs) of every kernel launch the wrappers make."""
    import torch
    from triton.runtime.jit import JITFunction

    from hybrid_serve.kernels import attention_triton as attn
    from hybrid_serve.kernels import causal_conv1d_triton as conv
    from hybrid_serve.kernels import gated_delta_rule_triton as gdr
    from hybrid_serve.kernels import rmsnorm_triton as norm

    calls = []
    JITFunction.run = lambda self, *args, grid, warmup, **kw: calls.append((self, args, kw))
    dt = getattr(torch, dtype_name)

    def rnd(*shape):
        return torch.randn(*shape).to(dt)

    dim, H, HV, K, T = 2048, 4, 8, 128, 100
    states = rnd(5, dim, 3)
    conv.causal_conv1d_fn(
        rnd(T, dim).t(), rnd(dim, 4), None, states, torch.tensor([0, 40, T]),
        torch.tensor([1, 2]), torch.tensor([True, False]),
    )  # fmt: skip
    conv.causal_conv1d_update(rnd(4, dim), states, rnd(dim, 4), None, "silu", torch.arange(4))
    q, v = rnd(1, T, H, K), rnd(1, T, HV, K)
    g, beta, pool = -torch.rand(1, T, HV), torch.rand(1, T, HV).to(dt), torch.zeros(5, HV, K, K)
    gdr.chunk_gated_delta_rule(
        q, q, v, g, beta, initial_state=pool, initial_state_indices=torch.tensor([1, 2]),
        cu_seqlens=torch.tensor([0, 64, T]), use_qk_l2norm_in_kernel=True,
        track_offsets=torch.tensor([64, 0]), track_indices=torch.tensor([3, 0]),
    )  # fmt: skip
    step = [x[:, :4].transpose(0, 1) for x in (q, v, g, beta)]
    gdr.fused_recurrent_gated_delta_rule(
        step[0], step[0], step[1], step[2], step[3], initial_state=pool,
        initial_state_indices=torch.tensor([1, -1, 2, 3]), use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    gk = -torch.rand(1, T, HV, K)  # the per-channel (KDA) gate: the same kernels' GK variants
    gdr.chunk_gated_delta_rule(
        q, q, v, gk, beta, initial_state=pool, initial_state_indices=torch.tensor([1, 2]),
        cu_seqlens=torch.tensor([0, 64, T]), use_qk_l2norm_in_kernel=True,
        track_offsets=torch.tensor([64, 0]), track_indices=torch.tensor([3, 0]),
    )  # fmt: skip
    step_k = gk[:, :4].transpose(0, 1)
    gdr.fused_recurrent_gated_delta_rule(
        step[0], step[0], step[1], step_k, step[3], initial_state=pool,
        initial_state_indices=torch.tensor([1, -1, 2, 3]), use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    kv, r2t, qa = rnd(500, 2, 64), torch.zeros(4, 100, dtype=torch.int32), rnd(20, 8, 64)
    attn.extend_attention(qa, kv, kv, r2t, torch.tensor([1, 2]), [0, 30], [10, 10], 0.125)
    attn.decode_attention(qa[:4], kv, kv, r2t, torch.arange(4), torch.tensor([5, 6, 7, 8]), 0.1)
    attn.store_kv(kv, kv, torch.arange(4), qa[:4, :2], qa[:4, :2])
    norm.rms_norm_gated(rnd(64, 128), rnd(64, 128), torch.ones(128), 1e-6)
    return calls


def compile_launch(fn, args: tuple, kwargs: dict, arch: int):
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    values = dict(zip(fn.arg_names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    signature, constexprs = {}, {}
    for param, name in zip(fn.params, fn.arg_names, strict=True):
        value = values[name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    src = ASTSource(fn, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles for the GPU")
        return 2
    failures = 0
    for fn, fargs, fkwargs in launches(args.dtype):
        try:
            shared = compile_launch(fn, fargs, fkwargs, args.arch).metadata.shared
            flag = "  over the sm_90 limit" if shared > H100_SHARED_LIMIT else ""
            print(f"ok    {fn.__name__:28s} shared {shared:7d} B{flag}")
            failures += bool(flag)
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"ERROR {fn.__name__}: {type(e).__name__}: {e}")
    print("all kernels compile" if not failures else f"{failures} kernel(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
