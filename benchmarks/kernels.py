"""Kernel timings beside flash-linear-attention's, and the decode step with CUDA graphs.

1. Every op of the kernel set that `kernels.choose` picks for the device (Triton on CUDA) on
   inputs shaped like the `small` preset's layers (bf16 on GPU). Where flash-linear-attention
   (fla) has the same op and is importable, fla runs on the same inputs beside it; otherwise
   the table says fla is absent. fla has no pool form, so both sides get plain per-sequence
   states. Where fla runs, a second table gives the largest output difference between the two
   on shared inputs (outputs and final states), relative to the largest |fla output|.
2. With CUDA: one decode step of the `small` preset at batch 1, 8 and 64 through
   `scheduler.graph_runner.DecodeGraphRunner`, eager against CUDA-graph replay (both include
   the host-side input copy of a real step). A failed capture is reported with its reason.

Without CUDA it runs tiny shapes through the set chosen for the CPU (the C++ kernels where they
build, else the torch references) as a smoke test (the timings mean nothing there) and skips
the decode section.

Example: python -m benchmarks.kernels --json-out /tmp/kernels.json
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import importlib
import json
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch

from hybrid_serve import kernels
from hybrid_serve.kernels import KernelSet

DECODE_BATCHES = (1, 8, 64)


def time_ms(fn: Callable[[], object], warmup: int = 3, repeats: int = 20) -> float:
    """Mean wall time of fn in ms (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeats
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def load_fla() -> dict[str, Callable] | str:
    """fla's ops by our names, or the reason fla cannot be used. Call its delta rules with g= and
    beta= by name: fla's fused recurrent form takes other gates (gk, gv) between them."""
    try:
        gdr = importlib.import_module("fla.ops.gated_delta_rule")
        conv = importlib.import_module("fla.modules.convolution")
    except Exception as e:  # absent, or present but broken
        return f"flash-linear-attention is not importable ({type(e).__name__}: {e})"
    return {
        "chunk_gated_delta_rule": gdr.chunk_gated_delta_rule,
        "fused_recurrent_gated_delta_rule": gdr.fused_recurrent_gated_delta_rule,
        "causal_conv1d_fn": conv.causal_conv1d,
    }


def gdn_shapes(small: bool) -> tuple[int, int, int, int, int, int, int]:
    """(sequences, tokens each, key heads, value heads, head dim, conv channels, decode batch):
    the `small` preset's Gated DeltaNet layer, or tiny shapes."""
    return (2, 64, 2, 4, 32, 256, 4) if small else (8, 512, 4, 8, 128, 2048, 64)


def kernel_cases(
    dev: torch.device, small: bool, ops: KernelSet
) -> list[tuple[str, Callable, Callable | None]]:
    """(name, run ours (`ops`), run fla or None) on shared inputs."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n_seq, seq, H, HV, K, dim, batch = gdn_shapes(small)
    ctx, nH, nKV, D = (64, 4, 2, 32) if small else (1024, 8, 2, 64)
    T = n_seq * seq
    fla = load_fla()
    fla = fla if isinstance(fla, dict) else {}

    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, device=dev).to(dtype)

    cu = torch.arange(n_seq + 1, device=dev) * seq
    x, w = rnd(T, dim).t(), rnd(dim, 4)
    conv_states = rnd(n_seq + 1, dim, 3)
    slots = torch.arange(1, n_seq + 1, device=dev)
    has_init = torch.ones(n_seq, dtype=torch.bool, device=dev)
    cases = [
        (
            "causal_conv1d_fn",
            lambda: ops.causal_conv1d_fn(x, w, None, conv_states, cu, slots, has_init),
            fla.get("causal_conv1d_fn")
            and (lambda: fla["causal_conv1d_fn"](x.t()[None], w, activation="silu", cu_seqlens=cu)),
        ),
    ]
    xb, states_b = rnd(batch, dim), rnd(batch + 1, dim, 3)
    rows = torch.arange(1, batch + 1, device=dev)
    cases.append(
        (
            "causal_conv1d_update",
            lambda: ops.causal_conv1d_update(xb, states_b, w, None, "silu", rows),
            None,
        )
    )

    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, K)
    g = -torch.rand(1, T, HV, device=dev)
    beta = torch.rand(1, T, HV, device=dev).to(dt)
    h0 = torch.randn(n_seq, HV, K, K, device=dev)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ops_c = ops.chunk_gated_delta_rule, fla.get("chunk_gated_delta_rule")
    cases.append(
        (
            "chunk_gated_delta_rule",
            lambda: ops_c[0](q, k, v, g=g, beta=beta, cu_seqlens=cu, **kw),
            ops_c[1] and (lambda: ops_c[1](q, k, v, g=g, beta=beta, cu_seqlens=cu, **kw)),
        )
    )
    qd, kd, vd = rnd(batch, 1, H, K), rnd(batch, 1, H, K), rnd(batch, 1, HV, K)
    gd, bd = -torch.rand(batch, 1, HV, device=dev), torch.rand(batch, 1, HV, device=dev).to(dt)
    kw_d = dict(kw, initial_state=torch.randn(batch, HV, K, K, device=dev))
    ops_d = ops.fused_recurrent_gated_delta_rule, fla.get("fused_recurrent_gated_delta_rule")
    cases.append(
        (
            "fused_recurrent_gated_delta_rule",
            lambda: ops_d[0](qd, kd, vd, g=gd, beta=bd, **kw_d),
            ops_d[1] and (lambda: ops_d[1](qd, kd, vd, g=gd, beta=bd, **kw_d)),
        )
    )

    locs = batch * ctx + 1
    k_buf, v_buf = rnd(locs, nKV, D), rnd(locs, nKV, D)
    r2t = (torch.arange(batch * ctx, device=dev) + 1).reshape(batch, ctx).to(torch.int32)
    req = torch.arange(batch, device=dev)
    qa = rnd(batch * 16, nH, D)
    prefix, extend = [ctx - 16] * batch, [16] * batch
    seq_lens = torch.full((batch,), ctx, device=dev)
    cases += [
        (
            "extend_attention",
            lambda: ops.extend_attention(qa, k_buf, v_buf, r2t, req, prefix, extend, 0.125),
            None,
        ),
        (
            "decode_attention",
            lambda: ops.decode_attention(qa[:batch], k_buf, v_buf, r2t, req, seq_lens, 0.125),
            None,
        ),
        (
            "store_kv",
            lambda: ops.store_kv(k_buf, v_buf, r2t[0, :16], qa[:16, :nKV], qa[:16, :nKV]),
            None,
        ),
    ]
    xn, zn, wn = rnd(T * HV, K), rnd(T * HV, K), torch.ones(K, device=dev, dtype=dt)
    cases.append(("rms_norm_gated", lambda: ops.rms_norm_gated(xn, zn, wn, 1e-6), None))
    return cases


def bench_kernels(dev: torch.device, small: bool, ops: KernelSet) -> list[dict]:
    fla = load_fla()
    if isinstance(fla, str):
        print(f"{fla}: timing ours alone")
    impl = ops.backend
    print(f"{'kernel':34s} {'ours (' + impl + ') ms':>16s} {'fla ms':>10s}")
    rows = []
    for name, ours, theirs in kernel_cases(dev, small, ops):
        row = {"kernel": name, "impl": impl, "ours_ms": time_ms(ours), "fla_ms": None}
        if theirs:
            try:
                row["fla_ms"] = time_ms(theirs)
            except Exception as e:  # report, do not abort the table
                row["fla_error"] = f"{type(e).__name__}: {e}"
        fla_txt = "absent" if not theirs else f"{row['fla_ms']:.3f}" if row["fla_ms"] else "error"
        print(f"{name:34s} {row['ours_ms']:16.3f} {fla_txt:>10s}")
        rows.append(row)
    return rows


def fla_parity(dev: torch.device, small: bool, ops: KernelSet | None = None) -> list[dict]:
    """Max |ours - fla| over outputs and final states of the ops both have, on shared inputs
    (convolution from zero history: fla's initial state holds one column more than ours);
    ours are `ops`, by default the set `kernels.choose` picks for the device."""
    fla = load_fla()
    if isinstance(fla, str):
        return []
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ops = ops or kernels.choose(dev, dt)
    n_seq, seq, H, HV, K, dim, batch = gdn_shapes(small)
    T = n_seq * seq
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    def unit(*shape, dtype=dt):
        return torch.rand(*shape, generator=gen).to(dev, dtype)

    cu = torch.arange(n_seq + 1, device=dev) * seq
    x, w = rnd(T, dim), rnd(dim, 4)
    states = rnd(n_seq, dim, 3)
    slots = torch.arange(n_seq, device=dev)
    no_init = torch.zeros(n_seq, dtype=torch.bool, device=dev)
    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, K)
    g, beta = -unit(1, T, HV, dtype=torch.float32), unit(1, T, HV)
    h0 = rnd(n_seq, HV, K, K, dtype=torch.float32)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    qd, kd, vd = rnd(batch, 1, H, K), rnd(batch, 1, H, K), rnd(batch, 1, HV, K)
    gd, bd = -unit(batch, 1, HV, dtype=torch.float32), unit(batch, 1, HV)
    hd = rnd(batch, HV, K, K, dtype=torch.float32)

    def fresh(op, h, *args, **kwargs):  # each side starts from its own copy of the state
        return op(*args, initial_state=h.clone(), **kwargs)

    chunk = ops.chunk_gated_delta_rule, fla["chunk_gated_delta_rule"]
    rec = ops.fused_recurrent_gated_delta_rule, fla["fused_recurrent_gated_delta_rule"]
    cases = {
        "causal_conv1d_fn": (
            lambda: [ops.causal_conv1d_fn(x.t(), w, None, states, cu, slots, no_init).t()],
            lambda: [fla["causal_conv1d_fn"](x[None], w, activation="silu", cu_seqlens=cu)[0][0]],
        ),
        "chunk_gated_delta_rule": tuple(
            partial(fresh, op, h0, q, k, v, g=g, beta=beta, cu_seqlens=cu, **kw) for op in chunk
        ),
        "fused_recurrent_gated_delta_rule": tuple(
            partial(fresh, op, hd, qd, kd, vd, g=gd, beta=bd, **kw) for op in rec
        ),
    }
    print(f"{'kernel':34s} {'max |ours-fla|':>15s} {'/ max |fla|':>12s}")
    rows = []
    for name, (ours, theirs) in cases.items():
        row: dict = {"kernel": name}
        try:
            a, b = list(ours()), list(theirs())
            pairs = zip(a, b, strict=True)
            diff = max((u.float() - t.float()).abs().max().item() for u, t in pairs)
            scale = max(t.float().abs().max().item() for t in b)
            row.update(max_abs_diff=diff, rel=diff / max(scale, 1e-30))
            print(f"{name:34s} {diff:15.3e} {row['rel']:12.3e}")
        except Exception as e:  # report, do not abort the table
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{name:34s} error: {row['error']}")
        rows.append(row)
    return rows


def bench_decode_graphs(preset: str = "small", device: str = "cuda", steps: int = 20) -> list[dict]:
    """Decode step of `preset` through `DecodeGraphRunner`: eager padded batches against CUDA-graph
    replay (graphs are captured on CUDA only; elsewhere the replay column reports why not)."""
    from hybrid_serve.make_model.presets import write_preset
    from hybrid_serve.scheduler.build import load_runner_model
    from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
    from hybrid_serve.scheduler.model_runner import (
        DecodeInput,
        ExtendInput,
        ModelRunner,
        RunnerConfig,
    )

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = RunnerConfig(
            max_running_requests=max(DECODE_BATCHES),
            max_total_tokens=65536,
            dtype="bfloat16" if device == "cuda" else "float32",
            device=device,
        )
        runner = ModelRunner(load_runner_model(str(write_preset(preset, tmp)), config), config)
        eager = DecodeGraphRunner(runner, list(DECODE_BATCHES), use_graphs=False)
        graphs, graph_error = None, "no CUDA"
        if device == "cuda":
            try:
                graphs = DecodeGraphRunner(runner, list(DECODE_BATCHES), use_graphs=True)
            except Exception as e:  # e.g. a host sync inside the step
                graph_error = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0]}"
        prompt = list(range(3, 35))
        for bs in DECODE_BATCHES:
            reqs, slots = runner.req_pool.alloc(bs), runner.mamba_pool.alloc(bs).tolist()
            items = [ExtendInput(r, m, 0, prompt) for r, m in zip(reqs, slots, strict=True)]
            locs = [runner.alloc_kv(r, 0, len(prompt)) for r in reqs]
            runner.forward(runner.build_prefill(items, locs))
            step = [DecodeInput(r, m, len(prompt), 5) for r, m in zip(reqs, slots, strict=True)]
            out_loc = runner.alloc_decode_kv(reqs, [len(prompt)] * bs)
            row = {"batch": bs}
            row["eager_ms"] = time_ms(partial(eager.forward, step, out_loc), 3, steps)
            if graphs is not None:
                row["graph_ms"] = time_ms(partial(graphs.forward, step, out_loc), 3, steps)
            else:
                row["graph_error"] = graph_error
            graph_txt = f"{row['graph_ms']:.3f} ms" if "graph_ms" in row else graph_error
            print(f"decode bs={bs:3d}: eager {row['eager_ms']:.3f} ms, graph {graph_txt}")
            rows.append(row)
            for r in reqs:
                runner.free_kv(r, len(prompt) + 1)
            runner.req_pool.free(reqs)
            runner.mamba_pool.free(slots)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--small", action="store_true", help="tiny shapes (default off CUDA)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("no CUDA: tiny shapes, a smoke run only")
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    ops = kernels.choose(dev, torch.bfloat16 if cuda else torch.float32)
    result["kernels"] = bench_kernels(dev, args.small or not cuda, ops)
    result["fla_parity"] = fla_parity(dev, args.small or not cuda, ops)
    if cuda:
        result["decode"] = bench_decode_graphs()
    else:
        print("no CUDA: skipping the CUDA-graph decode benchmark")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
