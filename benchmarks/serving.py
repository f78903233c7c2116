"""Online serving benchmark against an OpenAI-compatible server, in the manner of SGLang's
bench_serving.

Workloads (`--dataset`): `random` (random-token prompts of `--random-input-len` tokens and
`--random-output-len` output tokens, both scaled by `--random-range-ratio`), `shared-prefix`
(`--gsp-num-groups` random system prompts of `--gsp-system-prompt-len` tokens, each followed by
`--gsp-prompts-per-group` random questions of `--gsp-question-len` tokens, shuffled) and `gsm8k`
(few-shot GSM8K prompts). Tokens are counted with `--tokenizer`, a local checkpoint directory
(default: `--model`, or else the model `root` listed by the server's /v1/models, when that is
one); `--token-ids` sends the random prompts as token ids instead of decoded text.

Requests are streamed (`/v1/completions`, or `/v1/chat/completions` with `--chat`) at
temperature 0 with `ignore_eos`, so every request produces its full output length. They arrive
as a Poisson process of `--request-rate` per second (`inf`: all at once), at most
`--max-concurrency` in flight. Before the timed run: `--warmup-requests` short requests,
optionally `/flush_cache` (`--flush-cache`) and, for shared-prefix, each system prompt sent once
on its own (`--gsp-prewarm`: a prefix cache that stores states only at the ends of earlier
prompts, like the `no_buffer` strategy, can then reuse them). Failed requests are counted, never
fatal. Metrics: see `benchmarks.serving_metrics`. One JSON line is appended to `--output-file`.

Example: python -m benchmarks.serving --base-url http://127.0.0.1:30000 --tokenizer DIR \
    --dataset random --num-prompts 64 --random-input-len 32 --random-output-len 64 \
    --max-concurrency 8
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import logging
import random
import time

import httpx
from tqdm import tqdm

from benchmarks import gsm8k_data, serving_datasets, serving_metrics
from benchmarks.openai_client import (
    RequestResult,
    api_root,
    endpoint,
    first_model_id,
    make_client,
    make_payload,
    send,
)
from benchmarks.serving_datasets import DatasetRow

logger = logging.getLogger("benchmarks.serving")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:30000", help="with or without /v1")
    a("--model", default=None, help="model name (default: first of /v1/models)")
    a("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    a(
        "--tokenizer",
        default=None,
        help="local checkpoint dir (default: --model or the server's model root)",
    )
    a("--chat", action="store_true", help="use /v1/chat/completions")
    a("--dataset", choices=serving_datasets.DATASETS, default="random")
    a("--num-prompts", type=int, default=100, help="random and gsm8k datasets")
    a("--seed", type=int, default=0)
    a("--random-input-len", type=int, default=256)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=1.0)
    a("--token-ids", action="store_true", help="send random prompts as token ids")
    a("--gsp-num-groups", type=int, default=4)
    a("--gsp-prompts-per-group", type=int, default=8)
    a("--gsp-system-prompt-len", type=int, default=1024)
    a("--gsp-question-len", type=int, default=32)
    a("--gsp-output-len", type=int, default=32)
    a("--gsp-prewarm", action="store_true", help="send each system prompt alone first")
    a("--data-path", default=str(gsm8k_data.default_data_dir()), help="GSM8K jsonl directory")
    a("--download", action="store_true", help="fetch missing GSM8K files from GitHub")
    a("--num-shots", type=int, default=5)
    a("--gsm8k-output-len", type=int, default=256)
    a("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson), or inf")
    a("--max-concurrency", type=int, default=None)
    a("--disable-ignore-eos", action="store_true")
    a("--disable-stream", action="store_true", help="no streaming (no TTFT/ITL)")
    a("--warmup-requests", type=int, default=1)
    a("--flush-cache", action="store_true", help="POST /flush_cache before the timed run")
    a("--timeout", type=float, default=3600.0, help="per-request timeout in s")
    a("--output-file", default=None, help="append one JSON line of results here")
    a("--output-details", action="store_true", help="include per-request figures in the JSON")
    a("--plot", default=None, help="write a PNG of the latency distributions here")
    a("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.token_ids and args.chat:
        p.error("--token-ids needs /v1/completions (drop --chat)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    return args


def tokenizer_path(args: argparse.Namespace) -> str | None:
    """`--tokenizer`, else `--model` if it is a local directory, else the `root` that the server's
    `/v1/models` lists for its first model if that is a local directory, else None."""
    if args.tokenizer:
        return args.tokenizer
    if args.model and Path(args.model).is_dir():
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.get(
            api_root(args.base_url) + "/v1/models", headers=headers, timeout=30, trust_env=False
        )
        root = (resp.json().get("data") or [{}])[0].get("root")
    except (httpx.HTTPError, ValueError, AttributeError, IndexError):
        return None
    return root if root and Path(root).is_dir() else None


def build_dataset(args: argparse.Namespace) -> tuple[list[DatasetRow], list]:
    """The rows to send and the prefixes to pre-warm (shared-prefix only)."""
    tok_path = tokenizer_path(args)
    if args.dataset == "gsm8k":
        tok = serving_datasets.load_tokenizer(tok_path) if tok_path else None
        rows = serving_datasets.sample_gsm8k(
            args.data_path,
            args.num_prompts,
            args.num_shots,
            args.gsm8k_output_len,
            tok,
            args.download,
        )
        return rows, []
    if tok_path is None:
        raise SystemExit(f"--dataset {args.dataset} needs --tokenizer DIR (a local checkpoint)")
    tok = serving_datasets.load_tokenizer(tok_path)
    if args.dataset == "random":
        rows = serving_datasets.sample_random(
            tok,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            args.token_ids,
        )
        return rows, []
    rows, prefixes = serving_datasets.sample_shared_prefix(
        tok,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        args.seed,
        args.token_ids,
    )
    return rows, prefixes if args.gsp_prewarm else []


async def run_benchmark(args: argparse.Namespace, rows: list[DatasetRow], prefixes: list):
    """Warm up, then send `rows`; returns (model, results in row order, timed wall seconds)."""
    url = endpoint(args.base_url, args.chat)
    ignore_eos, stream = not args.disable_ignore_eos, not args.disable_stream
    limit = args.max_concurrency or len(rows) or 1
    async with make_client(args.api_key, args.timeout, limit) as client:
        model = args.model or await first_model_id(client, args.base_url) or "default"

        def body(prompt: str | list[int], max_tokens: int, eos: bool = ignore_eos) -> dict:
            return make_payload(
                model, prompt, max_tokens, chat=args.chat, stream=stream, ignore_eos=eos
            )

        warm = [
            send(client, url, body(rows[0].prompt, min(rows[0].output_len, 16)), chat=args.chat)
            for _ in range(args.warmup_requests if rows else 0)
        ]
        for r in await asyncio.gather(*warm):
            if not r.success:
                logger.warning("warm-up request failed: %s", r.error)
        if args.flush_cache:
            await flush_cache(client, args.base_url)
        for r in await asyncio.gather(
            *(send(client, url, body(p, 1, False), chat=args.chat) for p in prefixes)
        ):
            if not r.success:
                logger.warning("pre-warm request failed: %s", r.error)

        sem = asyncio.Semaphore(limit)
        bar = tqdm(total=len(rows), desc=f"serving {args.dataset}", disable=args.no_progress)

        async def one(row: DatasetRow) -> RequestResult:
            async with sem:
                res = await send(client, url, body(row.prompt, row.output_len), chat=args.chat)
            bar.update(1)
            return res

        rng = random.Random(args.seed)
        start = time.perf_counter()
        tasks = []
        for row in rows:
            tasks.append(asyncio.create_task(one(row)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return model, list(results), duration


async def flush_cache(client: httpx.AsyncClient, base_url: str) -> None:
    try:
        resp = await client.post(api_root(base_url) + "/flush_cache")
        if resp.status_code != 200:
            logger.warning("/flush_cache answered %d: %s", resp.status_code, resp.text[:200])
    except httpx.HTTPError as exc:
        logger.warning("/flush_cache failed: %s", exc)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON record (also appended to `--output-file`)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    try:
        rows, prefixes = build_dataset(args)
    except (OSError, ValueError) as exc:  # missing GSM8K files, a tokenizer that is not a dir
        raise SystemExit(f"error: {exc}") from exc
    logger.info(
        "%s: %d requests, %d input tokens (by the tokenizer), %d output tokens asked",
        args.dataset,
        len(rows),
        sum(r.prompt_len for r in rows),
        sum(r.output_len for r in rows),
    )
    model, results, duration = asyncio.run(run_benchmark(args, rows, prefixes))
    ignore_eos = not args.disable_ignore_eos
    metrics = serving_metrics.compute_metrics(rows, results, duration, ignore_eos)
    errors = sorted({r.error for r in results if not r.success})
    for err in errors[:5]:
        logger.warning("failed request: %s", err)
    backend = "openai-chat" if args.chat else "openai-completions"
    serving_metrics.print_table(
        metrics,
        {
            "Backend": backend,
            "Dataset": args.dataset,
            "Traffic request rate": args.request_rate,
            "Max request concurrency": args.max_concurrency or "not set",
        },
    )
    rate = args.request_rate if args.request_rate != float("inf") else "inf"  # strict JSON
    record = {
        "backend": backend,
        "dataset": args.dataset,
        "model": model,
        "base_url": args.base_url,
        "request_rate": rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(rows),
        "ignore_eos": ignore_eos,
        "stream": not args.disable_stream,
        **metrics,
        "error_samples": errors[:5],
        "args": vars(args) | {"request_rate": rate},
    }
    if args.output_details:
        record["requests"] = [
            {
                "prompt_len": row.prompt_len,
                "output_len": row.output_len,
                "success": r.success,
                "error": r.error or None,
                "ttft": r.ttft,
                "latency": r.latency,
                "itl": r.itl,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "cached_tokens": r.cached_tokens,
                "group": row.group,
            }
            for row, r in zip(rows, results, strict=True)
        ]
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    if args.plot:
        samples = serving_metrics.latency_samples(rows, results, ignore_eos)
        serving_metrics.plot(
            samples,
            args.plot,
            f"{backend} {args.dataset}, concurrency {args.max_concurrency or 'unbounded'}",
        )
        logger.info("wrote %s", args.plot)
    return record


if __name__ == "__main__":
    main()
