"""`hybrid-serve` command line.

    hybrid-serve [--model-path DIR] [--host H] [--port P] [...]   the HTTP server (server/args.py)
    hybrid-serve make-model --preset tiny|small|tiny-qwen3.5|tiny-qwen3.5-moe --out DIR
        [--seed N] [--multimodal] [--fp8] [--mtp] [--chat-template NAME]
        [--fit-mtp [--fit-steps N] [--fit-prompts N] [--fit-time-limit S]]
    hybrid-serve make-model --preset qwen3.5-35b-a3b --config-only --out DIR   (any preset:
        config.json, generation_config.json and the presets' tokenizer, no weights; serve it
        with --load-format dummy)
    hybrid-serve generate [--model-path DIR] [--prompt TEXT] [--max-new-tokens N] ...
        [every RunnerConfig field but the three sizes it sets itself, as --flag-name]

With no `--model-path` the server (and `generate`) use the `tiny` preset, written on first use to
`~/.cache/hybrid-serve/tiny` (`$HYBRID_SERVE_CACHE` moves the cache). `generate` runs one offline
generation through the `Engine` (the server's scheduler loop, in-process), without a server. Bad
input ends with a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from hybrid_serve.make_model.cli import add_make_model_parser
from hybrid_serve.scheduler.cpu_env import apply_cpu_defaults
from hybrid_serve.server.model_path import checkpoint_dir

logger = logging.getLogger("hybrid-serve")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# what AutoTokenizer reads (a fast tokenizer, or a slow one's vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def cmd_generate(args: argparse.Namespace) -> None:
    """One prompt through the offline `Engine`: the same loop, stop rules and results as the
    server, sized for this one request."""
    from hybrid_serve.scheduler.config import RunnerConfig
    from hybrid_serve.scheduler.engine import Engine
    from hybrid_serve.scheduler.sampling_params import SamplingParams
    from hybrid_serve.server.args import config_values

    path = checkpoint_dir(args.model_path)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=list(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
    )
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path).encode(args.prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    tokens = len(ids) + params.max_new_tokens + 1
    runner = config_values(args, RunnerConfig)
    runner.update(max_running_requests=1, max_total_tokens=tokens, max_context_len=tokens)
    engine = Engine(str(path), **runner)
    start = time.perf_counter()
    out = engine.generate(ids, params)
    elapsed = time.perf_counter() - start
    sys.stdout.write(out["text"] + "\n")
    meta = out["meta_info"]
    logger.info(
        "%d prompt + %d new tokens in %.2fs (%.1f tok/s), finish reason %s",
        meta["prompt_tokens"],
        meta["completion_tokens"],
        elapsed,
        meta["completion_tokens"] / elapsed,
        meta["finish_reason"],
    )
    if meta.get("spec_verify_ct"):
        logger.info(
            "speculative: %d verify rounds, accept length %.2f",
            meta["spec_verify_ct"],
            meta["completion_tokens"] / meta["spec_verify_ct"],
        )


# RunnerConfig fields `generate` sets itself: the pools sized for its one request
GENERATE_SIZES = ("max_running_requests", "max_total_tokens", "max_context_len")


def build_parser() -> argparse.ArgumentParser:
    from hybrid_serve.scheduler.config import RunnerConfig
    from hybrid_serve.server.args import add_fields

    parser = argparse.ArgumentParser(prog="hybrid-serve", description="offline commands")
    sub = parser.add_subparsers(dest="command", required=True)

    add_make_model_parser(sub)

    gen = sub.add_parser("generate", help="one offline generation (no server)")
    gen.add_argument(
        "--model-path", default=None, help="checkpoint directory (default: tiny preset)"
    )
    gen.add_argument("--prompt", default="The answer to 12 + 30 is")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--stop-token-ids", type=int, nargs="+", default=[], help="stop at any of these tokens"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_fields(gen.add_argument_group("RunnerConfig"), RunnerConfig, set(), GENERATE_SIZES)
    gen.set_defaults(func=cmd_generate)
    return parser


SUBCOMMANDS = ("make-model", "generate")


def main(argv: list[str] | None = None) -> None:
    apply_cpu_defaults()  # before anything loads torch (its OpenMP and allocator)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        args = build_parser().parse_args(argv)
        try:
            args.func(args)
        except (ValueError, FileNotFoundError, OSError) as e:
            sys.stderr.write(f"hybrid-serve: error: {e}\n")
            sys.exit(2)
        return
    from hybrid_serve.server.args import build_serve_parser, configs_from_args
    from hybrid_serve.server.launch import serve

    parser = build_serve_parser()
    args = parser.parse_args(argv)
    try:
        configs = configs_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    path = Path(configs[0].model_path or ".")  # a checkpoint (config.json) with no tokenizer
    if (path / "config.json").is_file() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        parser.error(
            f"no tokenizer files in {path} (the server needs them; make-model --config-only "
            "writes the presets' tokenizer)"
        )
    logging.basicConfig(level=configs[0].log_level.upper(), format=LOG_FORMAT)
    try:
        status = serve(*configs)
    except (ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"hybrid-serve: error: {e}\n")
        sys.exit(2)
    sys.exit(status)


if __name__ == "__main__":
    main()
