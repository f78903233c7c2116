"""`hybrid-serve` command line.

    hybrid-serve [--model-path DIR] [--host H] [--port P] [...]   the HTTP server (server/args.py)
    hybrid-serve make-model --preset tiny|small|tiny-qwen3.5|tiny-qwen3.5-moe --out DIR
        [--seed N] [--multimodal] [--fp8] [--mtp] [--chat-template NAME]
        [--fit-mtp [--fit-steps N] [--fit-prompts N] [--fit-time-limit S]]
    hybrid-serve make-model --preset qwen3.5-35b-a3b --config-only --out DIR   (any preset:
        config.json, generation_config.json and the presets' tokenizer, no weights; serve it
        with --load-format dummy)
    hybrid-serve generate [--model-path DIR] [--prompt TEXT] [--max-new-tokens N] ...

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

from scheduler.cpu_env import apply_cpu_defaults
from server.model_path import checkpoint_dir

logger = logging.getLogger("hybrid-serve")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# models.presets' names, spelled out so that the CLI imports no torch to build its parser
PRESET_NAMES = (
    "tiny",
    "small",
    "tiny-qwen3.5",
    "tiny-qwen3.5-moe",
    # models.real_shapes: the released models' shapes (--config-only for --load-format dummy)
    "qwen3.5-2b",
    "qwen3.5-9b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
    "qwen3-next-80b-a3b",
)
# what AutoTokenizer reads (a fast tokenizer, or a slow one's vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# models.chat_templates' names, likewise
CHAT_TEMPLATE_NAMES = ("qwen3-next-instruct", "qwen3-next-thinking", "qwen3.5", "qwen3.5-small")


def cmd_make_model(args: argparse.Namespace) -> None:
    import torch

    from models.presets import (
        count_parameters,
        preset_config,
        write_checkpoint,
        write_config_only,
    )
    from models.real_shapes import CHAT_TEMPLATES, REAL_SHAPES

    start = time.perf_counter()
    fit_options = {
        key: value
        for key, value in (
            ("steps", args.fit_steps),
            ("prompts", args.fit_prompts),
            ("time_limit", args.fit_time_limit),
        )
        if value is not None
    }
    if fit_options and not args.fit_mtp:
        raise ValueError("--fit-steps / --fit-prompts / --fit-time-limit need --fit-mtp")
    if args.fit_mtp and args.config_only:
        raise ValueError("--fit-mtp fits the head's weights: --config-only writes none")
    config = preset_config(args.preset)
    if (
        args.mtp or args.fit_mtp
    ):  # the multi-token-prediction head, as the releases ship it (one layer)
        config["mtp_num_hidden_layers"] = 1
    template = args.chat_template or CHAT_TEMPLATES.get(args.preset)
    if args.config_only:
        if args.fp8 or args.multimodal:
            raise ValueError("--config-only writes no weights: drop --fp8 / --multimodal")
        out = write_config_only(args.out, config, chat_template=template)
        logger.info(
            "wrote %s (%s config only): serve it with --load-format dummy", out, args.preset
        )
        return
    n = count_parameters(config)
    fp8 = {"dtype": torch.bfloat16, "fp8_block": (128, 128)} if args.fp8 else {}
    if args.preset in REAL_SHAPES and not fp8:  # the releases' dtype; drawn in fp32 first
        fp8 = {"dtype": torch.bfloat16}
        gb = f"{2 * n / 1e9:.1f} GB of bf16 weights ({4 * n / 1e9:.1f} GB of memory while drawing)"
        logger.info("%s: writing %s", args.preset, gb)
    out = write_checkpoint(
        args.out, config, seed=args.seed, multimodal=args.multimodal, chat_template=template, **fp8
    )
    took = time.perf_counter() - start
    logger.info("wrote %s (%s preset, %.1fM parameters) in %.1fs", out, args.preset, n / 1e6, took)
    if args.fit_mtp:
        from scheduler.mtp_fitting import fit_checkpoint

        result = fit_checkpoint(out, seed=args.seed, **fit_options)
        logger.info(
            "fitted the MTP head of %s: accept rate %.3f -> %.3f on held-out prompts "
            "(%.3f -> %.3f on its training prompts), %.1fs in all",
            out,
            result.before,
            result.after,
            result.train_before,
            result.train_after,
            time.perf_counter() - start,
        )


def cmd_generate(args: argparse.Namespace) -> None:
    """One prompt through the offline `Engine`: the same loop, stop rules and results as the
    server, sized for this one request."""
    from scheduler.engine import Engine
    from scheduler.sampling_params import SamplingParams

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
    engine = Engine(
        str(path),
        max_running_requests=1,
        max_total_tokens=tokens,
        max_context_len=tokens,
        dtype=args.dtype,
        load_format=args.load_format,
        quantization=args.quantization,
        speculative_algorithm=args.speculative_algorithm,
        speculative_num_steps=args.speculative_num_steps,
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-serve", description="offline commands")
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a deterministic random-weight checkpoint")
    mk.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument(
        "--multimodal",
        action="store_true",
        help="Qwen3.5 presets: the vision-language release's layout (text_config, "
        "model.language_model.* weights, a vision tower to skip, an MTP head stand-in unless "
        "--mtp)",
    )
    mk.add_argument(
        "--fp8",
        action="store_true",
        help="the official block-FP8 layout: e4m3 matrices with 128x128 weight_scale_inv, the "
        "rest bf16, quantization_config in config.json",
    )
    mk.add_argument(
        "--mtp",
        action="store_true",
        help="add the multi-token-prediction head (mtp.*, one layer; config "
        "mtp_num_hidden_layers 1), drawn after the other weights, which stay as without it",
    )
    mk.add_argument(
        "--fit-mtp",
        action="store_true",
        help="implies --mtp; then fit the head to the written main model (greedy continuations "
        "of random prompts, CPU training) and rewrite its mtp.* tensors; logs the accept rate "
        "before and after (scheduler/mtp_fitting.py)",
    )
    mk.add_argument(
        "--fit-steps", type=int, default=None, help="--fit-mtp: optimizer steps (default 200)"
    )
    mk.add_argument(
        "--fit-prompts",
        type=int,
        default=None,
        help="--fit-mtp: training sequences (default 96; 16 more are held out)",
    )
    mk.add_argument(
        "--fit-time-limit",
        type=float,
        default=None,
        help="--fit-mtp: stop training after this many seconds (default: no limit)",
    )
    mk.add_argument(
        "--chat-template",
        choices=CHAT_TEMPLATE_NAMES,
        default=None,
        help="the chat template written (default: the preset family's, qwen3-next-instruct or "
        "qwen3.5; models/chat_templates.py)",
    )
    mk.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json, generation_config.json and the tokenizer but no weights (bf16 "
        "config), for --load-format dummy; the way to get a real-shape model (qwen3.5-*, "
        "qwen3-next-80b-a3b)",
    )
    mk.set_defaults(func=cmd_make_model)

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
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    gen.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights"
    )
    gen.add_argument(
        "--quantization", default=None, choices=["int8", "int4"], help="weight-only, CPU"
    )
    gen.add_argument(
        "--speculative-algorithm", default=None, choices=["NEXTN"], help="draft with the MTP head"
    )
    gen.add_argument("--speculative-num-steps", type=int, default=0, help="drafts per step (0: 3)")
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
    from server.args import build_serve_parser, configs_from_args
    from server.launch import serve

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
