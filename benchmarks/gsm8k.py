"""Few-shot GSM8K against any OpenAI-compatible server.

Each test question is asked with `--num-shots` worked train examples in front (see
`benchmarks.gsm8k_data`), greedily (temperature 0), with `--max-tokens` (512) and stop strings
"Question" plus the usual end-of-turn texts, through `/v1/completions` (or
`/v1/chat/completions` with `--chat`, the whole few-shot text as one user message),
`--parallel` requests at a time. Answers are scored under SGLang's rule (the reported Accuracy and
Invalid) and lm-eval's strict-match and flexible-extract (see `benchmarks.scoring`).

A request that fails (HTTP error, broken connection, error event) is counted in `errors`, scored
as an empty answer (wrong, invalid) and the run goes on. Latency is the wall time of all requests;
output throughput = the sum of `usage.completion_tokens` / latency.

One JSON line is appended to `--result-file` (SGLang's result.jsonl shape plus our fields;
default `result.jsonl` in the current working directory, the path is logged at the end);
`--raw-result-file` gets one line per question.

Example: python -m benchmarks.gsm8k --base-url http://127.0.0.1:30000 --num-questions 200
(or `python benchmarks/gsm8k.py ...`: every benchmark script runs both ways)
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
import time

from tqdm import tqdm

from benchmarks import gsm8k_data, scoring
from benchmarks.openai_client import (
    RequestResult,
    endpoint,
    first_model_id,
    make_client,
    make_payload,
    send,
)

logger = logging.getLogger("benchmarks.gsm8k")

DEFAULT_STOP = ["Question", "</s>", "<|im_end|>", "<|endoftext|>"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="with or without /v1")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--data-path",
        default=str(gsm8k_data.default_data_dir()),
        help="directory with train.jsonl and test.jsonl",
    )
    p.add_argument("--download", action="store_true", help="fetch missing files from GitHub")
    p.add_argument("--num-shots", type=int, default=5)
    p.add_argument("--num-questions", type=int, default=None, help="default: all 1319")
    p.add_argument("--parallel", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--stop", nargs="*", default=DEFAULT_STOP)
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout in s")
    p.add_argument(
        "--result-file",
        default="result.jsonl",
        help="append one JSON line here (default: result.jsonl in the current directory)",
    )
    p.add_argument("--raw-result-file", default=None, help="write per-question JSON lines here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    if args.parallel < 1 or args.max_tokens < 1 or args.num_shots < 0:
        p.error("--parallel and --max-tokens must be >= 1, --num-shots >= 0")
    return args


async def ask_all(args: argparse.Namespace, prompts: list[str]) -> tuple[str, list, float]:
    """Send every prompt, `args.parallel` at a time; (model, results in order, wall seconds)."""
    url = endpoint(args.base_url, args.chat)
    results: list[RequestResult | None] = [None] * len(prompts)
    sem = asyncio.Semaphore(args.parallel)
    async with make_client(args.api_key, args.timeout, args.parallel) as client:
        model = args.model or await first_model_id(client, args.base_url) or "default"

        async def one(i: int) -> int:
            body = make_payload(
                model, prompts[i], args.max_tokens, chat=args.chat, stream=False, stop=args.stop
            )
            async with sem:
                results[i] = await send(client, url, body, chat=args.chat)
            return i

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        bar = tqdm(total=len(tasks), desc="gsm8k", disable=args.no_progress)
        for fut in asyncio.as_completed(tasks):
            i = await fut
            if not results[i].success:
                logger.warning("question %d failed: %s", i, results[i].error)
            bar.update(1)
        bar.close()
        latency = time.perf_counter() - start
    return model, results, latency


def main(argv: list[str] | None = None) -> dict:
    """Run the evaluation; returns the result line that was appended to `--result-file`."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    try:
        train = gsm8k_data.load_split(args.data_path, "train", download_missing=args.download)
        test = gsm8k_data.load_split(args.data_path, "test", download_missing=args.download)
    except OSError as exc:  # missing files or a failed download
        raise SystemExit(f"error: {exc}") from exc
    test = test[: args.num_questions] if args.num_questions is not None else test
    prompts = gsm8k_data.build_prompts(train, test, args.num_shots)
    model, results, latency = asyncio.run(ask_all(args, prompts))

    verdicts = [
        scoring.score(r.text if r.success else "", row["answer"])
        for r, row in zip(results, test, strict=True)
    ]
    summary = scoring.summarize(verdicts)
    errors = [r for r in results if not r.success]
    output_tokens = sum(r.completion_tokens or 0 for r in results if r.success)
    throughput = output_tokens / latency if latency > 0 else 0.0

    print(f"Accuracy: {summary['accuracy']:.3f}")
    print(f"Invalid: {summary['invalid']:.3f}")
    print(f"Latency: {latency:.3f} s")
    print(f"Output throughput: {throughput:.3f} token/s")
    print(
        f"Strict-match: {summary['strict_match']:.3f}   "
        f"Flexible-extract: {summary['flexible_extract']:.3f}"
    )
    print(f"Errors: {len(errors)} of {len(results)}")

    record = {
        "task": "gsm8k",
        "backend": "openai-chat" if args.chat else "openai-completions",
        "num_gpus": 1,
        "latency": latency,
        "accuracy": summary["accuracy"],
        "num_requests": len(results),
        "other": {"num_questions": len(results), "parallel": args.parallel},
        "model": model,
        "base_url": args.base_url,
        "num_shots": args.num_shots,
        "max_tokens": args.max_tokens,
        "strict_match": summary["strict_match"],
        "flexible_extract": summary["flexible_extract"],
        "invalid": summary["invalid"],
        "output_throughput": throughput,
        "output_tokens": output_tokens,
        "num_errors": len(errors),
        "error_samples": sorted({r.error for r in errors})[:5],
    }
    with open(args.result_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    logger.info("result appended to %s", Path(args.result_file).resolve())
    if args.raw_result_file:
        write_raw(Path(args.raw_result_file), test, results, verdicts)
    return record


def write_raw(path: Path, test: list[dict], results: list, verdicts: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, (row, r, v) in enumerate(zip(test, results, verdicts, strict=True)):
            line = {
                "idx": i,
                "question": row["question"],
                "label": scoring.sglang_answer(row["answer"]),
                "output": r.text,
                "error": r.error or None,
                "pred": v.sglang_pred,
                "strict_pred": v.strict_pred,
                "flexible_pred": v.flexible_pred,
                "correct": v.sglang,
                "completion_tokens": r.completion_tokens,
                "finish_reason": r.finish_reason,
            }
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
