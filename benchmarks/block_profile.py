"""Where the 16-row decode step's time goes: the probe behind issue 56's C=16 regression.

`phases` runs `benchmarks.engine_throughput`'s workload (C requests of `--prompt-len` random
ids, `--output-len` greedy tokens each) through our `Engine` and clocks every forward (the
model's `forward` and `final_hidden`, and the decode plan's call), keyed by kind and rows. It
prints, per wave, the wall time, the time inside forwards by key (calls, total, median per
call) and the rest (scheduling, sampling, the Python around the model). It reads only names
every tree since the per-family steps has (`Engine`, `scheduler.graph_runner.plan`,
`ForwardBatch.is_decode`), so the same file times an older checkout: copy it into that
checkout's benchmarks/ and run it there as a file (`python <old>/benchmarks/block_profile.py
phases ...`: a script puts its own tree's root first); run the two in turns to compare trees
on a shared machine.

`products` times the step's products at its shapes (from config.json, random bf16 weights,
enough copies to stream from memory) in one process, call by call in turns: our bf16 route
(`hybrid_serve::linear` on the copies packed in K-pair panels, as the loader packs them), torch's
bf16 product (oneDNN, as the per-family steps ran it past 15
rows) and (up to 16 rows) two calls of half the rows. `ops` times the
products and the Mamba2 decode op alone, one after the other.

Examples:
    python -m benchmarks.block_profile phases --model-path /tmp/nh3b --concurrency 16 \
        --prompt-len 32 --output-len 32 --waves 3 --threads 2
    python -m benchmarks.block_profile products --model-path /tmp/q35-2b --rows 16 --rounds 9
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import logging
import os
import statistics
import time
from collections import defaultdict

from hybrid_serve.scheduler.cpu_env import apply_cpu_defaults

apply_cpu_defaults()  # the server's OpenMP spin and huge pages, also when run as a file

import torch  # noqa: E402

from hybrid_serve.kernels.bf16_pack import pack_bf16  # noqa: E402

logger = logging.getLogger("benchmarks.block_profile")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


class ForwardClock:
    """Clocks every model forward: the model's own `forward` and `final_hidden` (prefill and
    eager decode) and the decode plan's call where the engine has one (each wrapped as an
    instance attribute), each call's wall time under (kind, rows): kind "decode" or "extend",
    "plan" for the plan; a call inside a clocked one is not clocked again."""

    def __init__(self, engine) -> None:
        self.times: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.depth = 0
        model = engine.runner.model
        model.forward = self._timed(model.forward, "")
        if hasattr(model, "final_hidden"):  # the prefill's path since the per-family steps
            model.final_hidden = self._timed(model.final_hidden, "")
        graphs = engine.scheduler.graph_runner
        if getattr(graphs, "plan", None) is not None:
            graphs.plan = _Timed(graphs.plan, self._timed(graphs.plan, "plan"))

    def _timed(self, inner, label: str):
        def timed(batch, *args, **kwargs):
            if self.depth:  # within a clocked call (final_hidden's own forward): not again
                return inner(batch, *args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                out = inner(batch, *args, **kwargs)
            finally:
                self.depth -= 1
            kind = label or ("decode" if batch.is_decode else "extend")
            self.times[kind, int(batch.input_ids.numel())].append(time.perf_counter() - start)
            return out

        return timed

    def reset(self) -> None:
        self.times.clear()


class _Timed:
    """A callable in place of the plan: its call clocked, its other attributes its own."""

    def __init__(self, inner, call) -> None:
        self._inner, self._call = inner, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def phases(args: argparse.Namespace) -> None:
    from hybrid_serve.scheduler.engine import Engine

    os.environ.setdefault("HYBRID_SERVE_KERNELS", "auto")
    engine = Engine(
        args.model_path,
        max_running_requests=args.concurrency,
        dtype=args.dtype,
        max_total_tokens=args.concurrency * (args.prompt_len + args.output_len + 8),
    )
    vocab = engine.runner.model.config.vocab_size
    clock = ForwardClock(engine)
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    engine.generate(_prompts(2, args.prompt_len, vocab, 99), {**params, "max_new_tokens": 4})
    engine.flush_cache()
    for wave in range(args.waves):
        clock.reset()
        start = time.perf_counter()
        engine.generate(_prompts(args.concurrency, args.prompt_len, vocab, wave), params)
        wall = time.perf_counter() - start
        engine.flush_cache()
        inside = sum(sum(v) for v in clock.times.values())
        tps = args.concurrency * args.output_len / wall
        print(
            f"wave {wave} load {os.getloadavg()[0]:.2f}: wall {wall:.3f} s ({tps:.2f} tok/s), "
            f"forwards {inside:.3f} s, rest {wall - inside:.3f} s"
        )
        for (kind, rows), ts in sorted(clock.times.items()):
            print(
                f"  {kind:6s} rows {rows:4d}: {len(ts):3d} calls, total {sum(ts):.3f} s, "
                f"median {statistics.median(ts) * 1e3:.2f} ms"
            )


# ---- ops: the 16-row step's pieces, one at a time ------------------------------------------


def _shapes(config: dict) -> tuple[list[tuple[str, int, int, int]], dict]:
    """(name, layers, N, K) of every product of one decode step, and the Mamba2 layer's
    shapes (empty without one), from a NemotronH or Qwen3.5 config.json."""
    c = config.get("text_config", config)
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    if c["model_type"] == "nemotron_h":
        pattern = c["hybrid_override_pattern"]
        n_m, n_mlp, n_a = pattern.count("M"), pattern.count("-"), pattern.count("*")
        inner = c["mamba_num_heads"] * c["mamba_head_dim"]
        groups, state = c["n_groups"], c["ssm_state_size"]
        in_n = 2 * inner + 2 * groups * state + c["mamba_num_heads"]
        hd, kv = c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
        products = [
            ("mamba in_proj", n_m, in_n, hidden),
            ("mamba out_proj", n_m, hidden, inner),
            ("mlp up", n_mlp, c["intermediate_size"], hidden),
            ("mlp down", n_mlp, hidden, c["intermediate_size"]),
            ("attn q", n_a, c["num_attention_heads"] * hd, hidden),
            ("attn k", n_a, kv, hidden),
            ("attn v", n_a, kv, hidden),
            ("attn o", n_a, hidden, c["num_attention_heads"] * hd),
            ("lm_head", 1, vocab, hidden),
        ]
        mamba = {"layers": n_m, "H": c["mamba_num_heads"], "P": c["mamba_head_dim"],
                 "N": state, "G": groups, "W": c["conv_kernel"]}  # fmt: skip
        return products, mamba
    n_a = sum(t == "full_attention" for t in c["layer_types"])
    n_g = len(c["layer_types"]) - n_a
    key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    hd, kv = c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    n_l = len(c["layer_types"])
    return [
        ("gdn qkvz", n_g, 2 * key + 2 * value, hidden),
        ("gdn ba", n_g, 2 * c["linear_num_value_heads"], hidden),
        ("gdn out", n_g, hidden, value),
        ("mlp gate", n_l, c["intermediate_size"], hidden),
        ("mlp up", n_l, c["intermediate_size"], hidden),
        ("mlp down", n_l, hidden, c["intermediate_size"]),
        ("attn q+gate", n_a, 2 * c["num_attention_heads"] * hd, hidden),
        ("attn k", n_a, kv, hidden),
        ("attn v", n_a, kv, hidden),
        ("attn o", n_a, hidden, c["num_attention_heads"] * hd),
        ("lm_head", 1, vocab, hidden),
    ], {}


def _copies(numel: int, budget: int = 96 << 20) -> int:
    """Copies of a bf16 weight that together pass the last-level cache, so each call streams
    its weight from memory as the step does."""
    return max(1, min(8, -(-budget // (2 * numel))))


def ops(args: argparse.Namespace) -> None:
    from hybrid_serve.kernels import cpp_build

    hs = cpp_build.load()
    if hs is None:
        raise SystemExit("the C++ kernels did not load")
    with open(os.path.join(args.model_path, "config.json")) as f:
        products, mamba = _shapes(json.load(f))
    gen = torch.Generator().manual_seed(0)
    rows = args.rows
    x_of = {}
    timed: list[tuple[str, int, object]] = []
    for name, layers, n, k in products:
        ws = [
            pack_bf16((torch.randn(n, k, generator=gen) * 0.02).bfloat16())
            for _ in range(_copies(n * k))
        ]  # the route's layout: K-pair panels, as the loader packs them
        x = x_of.setdefault(k, torch.randn(rows, k, generator=gen))
        ring = iter(range(1 << 62))
        timed.append(
            (
                name,
                layers,
                lambda ws=ws, x=x, ring=ring: hs.linear(x, ws[next(ring) % len(ws)], True),
            )
        )
    if mamba:
        H, P, N, G, W = (mamba[key] for key in "HPNGW")
        inner, conv_dim = H * P, H * P + 2 * G * N
        slots = torch.arange(rows, dtype=torch.long)
        zx = torch.randn(rows, 2 * inner + 2 * G * N + H, generator=gen)
        conv_state = torch.zeros(rows, conv_dim, W - 1)
        ssm_state = torch.zeros(rows, H, P, N)
        conv_w, a_log = torch.randn(conv_dim, W, generator=gen) * 0.1, torch.zeros(H)
        dt_bias, d, norm_w = torch.zeros(H), torch.ones(H), torch.ones(inner)

        def mamba2():
            return hs.mamba2_decode(zx, conv_state, conv_w, None, ssm_state, a_log, dt_bias, d,
                                    norm_w, slots, G, 1e-5, 0.0, float("inf"))  # fmt: skip

        timed.append(("mamba2_decode", mamba["layers"], mamba2))
    hidden = max(x_of)
    xn, wn = torch.randn(rows, hidden, generator=gen), torch.ones(hidden)

    def norm_plain():  # kernels/rmsnorm.py rms_norm_plain's ATen sequence, as the step's
        xf = xn.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return (wn * xf) + xn

    timed.append(("norm + residual", 1, norm_plain))
    for _, _, fn in timed:  # warm-up
        fn()
    medians = {}
    for name, layers, fn in timed:
        ts = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
        medians[name] = (layers, statistics.median(ts))
    level = cpp_build.loaded_level()
    print(f"level {level.name if level else '?'}, rows {rows}, load {os.getloadavg()[0]:.2f}")
    total = 0.0
    for name, (layers, t) in medians.items():
        total += layers * t
        print(f"  {name:16s} x{layers:3d}: {t * 1e3:8.3f} ms each, {layers * t * 1e3:8.2f} ms/step")
    print(f"  sum {total * 1e3:.1f} ms per step")


def products(args: argparse.Namespace) -> None:
    """In one process, alternating call by call over `--rounds`: every product of the step at
    `--rows` rows through our bf16 route (`hybrid_serve::linear`: the panel product), through
    torch's bf16 product as the per-family steps' tree ran it (oneDNN:
    `F.linear(x.bfloat16(), w).float()`), and (up to 16 rows) as two calls of half the rows.
    Prints each variant's median per product and per step, with the load average."""
    from hybrid_serve.kernels import cpp_build

    hs = cpp_build.load()
    if hs is None:
        raise SystemExit("the C++ kernels did not load")
    with open(os.path.join(args.model_path, "config.json")) as f:
        shapes, _ = _shapes(json.load(f))
    gen = torch.Generator().manual_seed(0)
    rows, half = args.rows, args.rows // 2
    variants = {
        "ours": lambda x, w: hs.linear(x, w[1], True),  # w: (rows, panels)
        "onednn": lambda x, w: torch.nn.functional.linear(x.bfloat16(), w[0]).float(),
        "halves": lambda x, w: torch.cat(
            [hs.linear(x[:half], w[1], True), hs.linear(x[half:], w[1], True)]
        ),  # fmt: skip
    }
    if rows > 16:  # prefill sizes: the halves would only double the run
        variants.pop("halves")
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    weights = {}
    for name, _, n, k in shapes:
        plain = [
            (torch.randn(n, k, generator=gen) * 0.02).bfloat16() for _ in range(_copies(n * k))
        ]
        weights[name] = [(w, pack_bf16(w)) for w in plain]  # torch reads rows, ours panels
    xs = {k: torch.randn(rows, k, generator=gen) for _, _, _, k in shapes}
    loads = []
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, _, _, k in shapes:
            ws = weights[name]
            for v, fn in variants.items():
                start = time.perf_counter()
                fn(xs[k], ws[r % len(ws)])
                if r:
                    times[name, v].append(time.perf_counter() - start)
        loads.append(os.getloadavg()[0])
    print(f"rows {rows}, {args.rounds} rounds, load {min(loads):.2f}-{max(loads):.2f}")
    print(f"  {'product':16s}{'x':>4s}" + "".join(f"{v:>12s}" for v in variants) + "  (ms each)")
    total = defaultdict(float)
    for name, layers, _, _ in shapes:
        meds = {v: statistics.median(times[name, v]) for v in variants}
        for v, t in meds.items():
            total[v] += layers * t
        print(f"  {name:16s}{layers:4d}" + "".join(f"{t * 1e3:12.3f}" for t in meds.values()))
    print(f"  {'per step':20s}" + "".join(f"{total[v] * 1e3:12.1f}" for v in variants))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("phases", help="an engine wave's forwards by kind and rows")
    p.add_argument("--model-path", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    o = sub.add_parser("ops", help="the step's products and mixer ops at its shapes, timed")
    o.add_argument("--model-path", required=True)
    o.add_argument("--rows", type=int, default=16)
    o.add_argument("--repeats", type=int, default=9)
    o.add_argument("--threads", type=int, default=2)
    b = sub.add_parser("products", help="the step's products: ours, oneDNN, two halves")
    b.add_argument("--model-path", required=True)
    b.add_argument("--rows", type=int, default=16)
    b.add_argument("--rounds", type=int, default=7)
    b.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)
    {"phases": phases, "ops": ops, "products": products}[args.command](args)


if __name__ == "__main__":
    main()
