"""What a speculative verify pass costs beside a plain decode step on the CPU decode plan, and
where the difference goes.

One request with a context of `--context-len` random tokens, prefilled once; every timed pass
starts from exactly that state. Timed alternately, medians of `--repeats`:

- `step`: a plain decode step, 1 row (`CpuDecodePlan.__call__`);
- `verify`: a verify pass of `--rows` rows (`CpuDecodePlan.verify`, the GDN layers keeping the
  state after each row but the last, as `hybrid_serve.scheduler.spec.worker` runs it);
- the products alone at 1 row and at `--rows` rows: the plan's product calls on the model's own
  weights with random activations, grouped as the plan groups them (each layer's input
  projections in one call, its output projection, a dense MLP's gate and up in one call, its
  down projection; the LM head). A sparse-MoE layer's products count in the rest.

The rest (GDN and conv updates, attention, norms, the embedding) is each pass less its
products. With `--profile`, the GDN layers' fused mixer ops alone, on the model's own
parameters and pools with random projections, clocked the same way: `gdn_decode` at 1 row and
`gdn_verify` at `--rows` rows (one request, its states kept in the step slots), and the
accepted state's copy back (`MambaPool.copy` of one step slot over the running one, as the
speculative worker rolls back a rejected row). Batches are built off the clock. Same-run
ratios are the figures: the speed of a shared VM drifts between runs.

Example:
  python -m benchmarks.verify_cost --model-path /work/q2b/qwen3.5-2b --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import logging
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from hybrid_serve.kernels.quant import in_features
from hybrid_serve.models.cpu_decode import CpuDecodePlan
from hybrid_serve.models.layers import MLP
from hybrid_serve.scheduler.build import load_runner_model
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig

logger = logging.getLogger("benchmarks.verify_cost")


def product_calls(model) -> list[tuple[str, list[torch.Tensor]]]:
    """(group, weights) of every product call of a decode pass, in the plan's grouping."""
    calls = []
    for layer in model.model.layers:
        if layer.is_full_attention:
            a = layer.self_attn
            calls += [("attention in", [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                      ("out proj", [a.o_proj.weight])]  # fmt: skip
        else:
            g = layer.linear_attn
            calls += [("GDN in", [g.in_proj_qkvz.weight, g.in_proj_ba.weight]),
                      ("out proj", [g.out_proj.weight])]  # fmt: skip
        if isinstance(layer.mlp, MLP):
            mlp = layer.mlp
            calls += [("MLP gate+up", [mlp.gate_proj.weight, mlp.up_proj.weight]),
                      ("MLP down", [mlp.down_proj.weight])]  # fmt: skip
    return [*calls, ("LM head", [model.lm_head.weight])]


def time_products(calls, rows: int, bf16_products: bool) -> dict[str, float]:
    """Seconds per group of one pass of `calls` at `rows` rows."""
    out: dict[str, float] = defaultdict(float)
    for name, weights in calls:
        x = torch.randn(rows, in_features(weights[0]))
        start = time.perf_counter()
        torch.ops.hybrid_serve.linear_multi(x, weights, bf16_products)
        out[name] += time.perf_counter() - start
    return out


def time_mixers(runner: ModelRunner, rows: int, seed: int) -> dict[str, float]:
    """Seconds of the GDN layers' mixer ops over one pass: `gdn_decode` at 1 row, `gdn_verify`
    at `rows` rows, and the rollback copy of a step slot over the running one (all layers)."""
    model, pool, ops = runner.model, runner.mamba_pool, torch.ops.hybrid_serve
    gen = torch.Generator().manual_seed(seed)
    live, *steps = (int(s) for s in pool.alloc(rows))
    slot = torch.tensor([live])
    starts, kept = torch.tensor([0, rows]), torch.tensor([steps])
    out: dict[str, float] = defaultdict(float)
    for layer in model.model.layers:
        if layer.is_full_attention:
            continue
        g = layer.linear_attn
        conv = g.conv1d.weight.squeeze(1).contiguous()
        i = g.linear_layer_id
        args = (conv, pool.ssm_state[i], g.A_log, g.dt_bias, g.norm.weight)
        for name, r in (("gdn_decode @1", 1), (f"gdn_verify @{rows}", rows)):
            qkvz = torch.randn(r, g.in_proj_qkvz.weight.shape[0], generator=gen)
            ba = torch.randn(r, g.in_proj_ba.weight.shape[0], generator=gen)
            start = time.perf_counter()
            if r == 1:
                ops.gdn_decode(qkvz, ba, pool.conv_state[i], *args, slot, g.num_k_heads,
                               g.norm.eps)  # fmt: skip
            else:
                ops.gdn_verify(qkvz, ba, pool.conv_state[i], *args, slot, starts, kept,
                               g.num_k_heads, g.norm.eps)  # fmt: skip
            out[name] += time.perf_counter() - start
    start = time.perf_counter()
    pool.copy([steps[0]], [live])
    out["rollback copy"] = time.perf_counter() - start
    pool.free([live, *steps])
    return out


def passes(runner: ModelRunner, plan: CpuDecodePlan, ctx: int, rows: int, seed: int):
    """(step, verify): callables that each restore the prefilled state off the clock and return
    the seconds of one pass."""
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    req = runner.req_pool.alloc(1)[0]
    live, snap, *steps = (int(s) for s in runner.mamba_pool.alloc(rows + 1))
    prompt = torch.randint(vocab, (ctx,), generator=gen).tolist()
    runner.forward(runner.build_prefill([ExtendInput(req, live, 0, prompt)],
                                        [runner.alloc_kv(req, 0, ctx)]))  # fmt: skip
    runner.mamba_pool.copy([live], [snap])
    locs = runner.alloc_kv(req, ctx, rows)
    ids = torch.randint(vocab, (rows,), generator=gen).tolist()
    plain = runner.build_decode([DecodeInput(req, live, ctx, ids[0])], locs[:1])
    item = ExtendInput(req, live, ctx, ids, step_slots=steps)
    verify = runner.build_prefill([item], [locs], return_all_logits=True, verify=True)

    def timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            runner.mamba_pool.copy([snap], [live])
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return run

    return timed(lambda: plan(plain)), timed(lambda: plan.verify(verify))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["int8", "int4"])
    p.add_argument("--rows", type=int, default=4, help="verify rows (1 + drafts)")
    p.add_argument("--context-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true",
                   help="also time the GDN mixer ops and the rollback copy alone")  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    ctx, rows = args.context_len, args.rows
    cfg = RunnerConfig(
        max_running_requests=2,
        max_total_tokens=ctx + rows + 64,
        max_context_len=ctx + rows + 1,
        mamba_cache_size=2 * rows + 3,
        dtype=args.dtype,
        quantization=args.quantization,
    )
    runner = ModelRunner(load_runner_model(args.model_path, cfg), cfg)
    model = runner.model
    plan = CpuDecodePlan.build(model, runner.kv_pool, runner.mamba_pool,
                               runner.req_pool.req_to_token)  # fmt: skip
    if not isinstance(plan, CpuDecodePlan):
        p.error("no Qwen3-Next/Qwen3.5 CPU decode plan for this model")
    calls = product_calls(model)
    load = [os.getloadavg()[0]]
    t: dict[str, list[float]] = defaultdict(list)
    with torch.inference_mode():
        step, verify = passes(runner, plan, ctx, rows, seed=0)
        for rep in range(args.repeats + 1):  # the first round warms up
            got = {"step": step(), "verify": verify()}
            for r in (1, rows):
                parts = time_products(calls, r, model.ops.bf16_products)
                got |= {f"{name} @{r}": s for name, s in parts.items()}
                got[f"products @{r}"] = sum(parts.values())
            if args.profile:
                got |= time_mixers(runner, rows, seed=rep)
            if rep:
                for k, v in got.items():
                    t[k].append(v)
            logger.info("round %d: step %.1f ms, verify %.1f ms", rep, 1e3 * got["step"],
                        1e3 * got["verify"])  # fmt: skip
    load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    weight_gb = sum(w.nbytes for _, ws in calls for w in ws) / 1e9
    quant = f", {args.quantization} matrices" if args.quantization else ""
    print(f"\n{Path(args.model_path).name}: {args.dtype}{quant}, {args.threads} threads, context "
          f"{ctx}, {rows}-row verify, {args.repeats} repeats, load average {load[0]:.1f} -> "
          f"{load[1]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"product weights {weight_gb:.2f} GB: {weight_gb / med['products @1'] * 1e3:.1f} GB/s "
          f"at 1 row")  # fmt: skip
    print(f"\n| ms (median) | 1 row | {rows} rows | ratio |\n|---|---|---|---|")
    row = lambda name, a, b: print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")  # noqa: E731
    row("pass (step / verify)", med["step"], med["verify"])
    row("products", med["products @1"], med[f"products @{rows}"])
    for name in dict.fromkeys(n for n, _ in calls):
        row(f"- {name}", med[f"{name} @1"], med[f"{name} @{rows}"])
    row("the rest", med["step"] - med["products @1"],
        med["verify"] - med[f"products @{rows}"])  # fmt: skip
    if args.profile:
        print(f"\n| ms (median), alone | 1 row | {rows} rows | ratio |\n|---|---|---|---|")
        row("GDN mixer ops (decode / verify)", med["gdn_decode @1"], med[f"gdn_verify @{rows}"])
        print(f"| rollback copy (a rejected row) | | {med['rollback copy']:.1f} | |")
    extra = med["verify"] - med["step"]
    products = med[f"products @{rows}"] - med["products @1"]
    print(f"\nverify - step: {extra:.1f} ms, of which products {products:.1f} ms")


if __name__ == "__main__":
    main()
