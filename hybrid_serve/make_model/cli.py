"""`hybrid-serve make-model`: write a deterministic random-weight checkpoint of a preset (or only
its config and tokenizer, for `--load-format dummy`), optionally with an MTP head fitted to it.
The parser imports no torch: it reads the preset names from the family table's rows
(`make_model.catalog`, plain data) and the chat templates' names from their torch-free module;
the command loads the writers when it runs."""

from __future__ import annotations

import argparse
import logging
import time

logger = logging.getLogger("hybrid-serve")

# the model_types whose MTP layers the config counts as num_nextn_predict_layers
NEXTN_TYPES = ("nemotron_h", "bailing_hybrid")


def cmd_make_model(args: argparse.Namespace) -> None:
    import torch

    from hybrid_serve.make_model.lfm2_preset import LFM2_FULL_SIZE
    from hybrid_serve.make_model.nemotron_h_preset import NEMOTRON_H_SCALED
    from hybrid_serve.make_model.presets import (
        count_parameters,
        preset_config,
        write_checkpoint,
        write_config_only,
    )
    from hybrid_serve.make_model.real_shapes import CHAT_TEMPLATES, REAL_SHAPES

    start = time.perf_counter()
    fit_options = _checked_options(args)
    config = preset_config(args.preset)
    if config.get("model_type") in NEXTN_TYPES and (args.mtp or args.fit_mtp):
        if args.fit_mtp:
            raise ValueError("--fit-mtp fits Qwen3-Next and Qwen3.5 heads only")
        # one step, as Nemotron 3 Super's head and Ling-3's MTP layer
        config["num_nextn_predict_layers"] = config.get("num_nextn_predict_layers") or 1
    elif args.mtp or args.fit_mtp:  # the multi-token-prediction head, one layer as released
        config["mtp_num_hidden_layers"] = 1
    template = args.chat_template or CHAT_TEMPLATES.get(args.preset)
    if args.config_only:
        if args.multimodal:
            raise ValueError("--config-only writes no weights: drop --multimodal")
        block = (128, 128) if args.fp8 else None  # --fp8: the FP8 form's quantization_config
        out = write_config_only(args.out, config, chat_template=template, fp8_block=block)
        logger.info(
            "wrote %s (%s config only): serve it with --load-format dummy", out, args.preset
        )
        return
    n = count_parameters(config)
    fp8 = {"dtype": torch.bfloat16, "fp8_block": (128, 128)} if args.fp8 else {}
    full_size = any(args.preset in d for d in (REAL_SHAPES, NEMOTRON_H_SCALED, LFM2_FULL_SIZE))
    if full_size and not fp8:  # the releases' dtype; drawn in fp32 first
        fp8 = {"dtype": torch.bfloat16}
        gb = f"{2 * n / 1e9:.1f} GB of bf16 weights ({4 * n / 1e9:.1f} GB of memory while drawing)"
        logger.info("%s: writing %s", args.preset, gb)
    out = write_checkpoint(
        args.out, config, seed=args.seed, multimodal=args.multimodal, chat_template=template, **fp8
    )
    took = time.perf_counter() - start
    logger.info("wrote %s (%s preset, %.1fM parameters) in %.1fs", out, args.preset, n / 1e6, took)
    if args.train_text:
        _train(out, args)
    if args.fit_mtp:
        _fit_mtp(out, args, fit_options, start)


def _checked_options(args: argparse.Namespace) -> dict:
    """The MTP fitting options given on the command line, after the checks that flags which
    need one another are given together (a `ValueError` naming them); `--train-minutes`
    defaults to 5 when neither training limit is given."""
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
    if not args.train_text and (args.train_minutes is not None or args.train_steps is not None):
        raise ValueError("--train-minutes / --train-steps need --train-text")
    if args.train_minutes is None and args.train_steps is None:
        args.train_minutes = 5.0
    if args.train_text and (args.config_only or args.fp8 or args.multimodal):
        raise ValueError("--train-text trains a plain float checkpoint: drop "
                         "--config-only / --fp8 / --multimodal")  # fmt: skip
    return fit_options


def _train(out, args: argparse.Namespace) -> None:
    """`make-model --train-text`: train the written checkpoint in place on the text."""
    from hybrid_serve.make_model.train_text import train_checkpoint

    r = train_checkpoint(
        out,
        args.train_text,
        args.train_minutes,
        seq_len=args.train_seq_len,
        batch_size=args.train_batch,
        lr=args.train_lr,
        seed=args.seed,
        steps=args.train_steps,
        precision=args.train_precision,
    )
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in r.phases.items())
    logger.info(
        "trained %s on %s: %d steps, %d tokens, loss %.3f -> %.3f, %.0fs (%s; %s forward)",
        out, args.train_text, r.steps, r.tokens, r.loss_first, r.loss_last, r.seconds,
        phases, r.precision,
    )  # fmt: skip


def _fit_mtp(out, args: argparse.Namespace, fit_options: dict, start: float) -> None:
    """`make-model --fit-mtp`: fit the written checkpoint's MTP head in place (on prompts cut
    from the training text when there is one)."""
    from hybrid_serve.make_model.mtp_fitting import fit_checkpoint

    if args.train_text:  # prompts from the text the model learnt
        from hybrid_serve.make_model.train_text import tokenize_text

        fit_options["text"] = tokenize_text(out, args.train_text)
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


def add_make_model_parser(sub: argparse._SubParsersAction) -> None:
    from hybrid_serve.make_model.catalog import preset_configs
    from hybrid_serve.make_model.chat_templates import TEMPLATES

    mk = sub.add_parser("make-model", help="write a deterministic random-weight checkpoint")
    _add_layout_args(mk, tuple(preset_configs()), tuple(TEMPLATES))
    _add_mtp_args(mk)
    _add_training_args(mk)
    mk.set_defaults(func=cmd_make_model)


def _add_layout_args(mk: argparse.ArgumentParser, presets: tuple, templates: tuple) -> None:
    """What is written: the preset, where, its seed, its layout and chat template."""
    mk.add_argument("--preset", choices=presets, default="tiny")
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
        "rest bf16, quantization_config in config.json (with --config-only: that config alone, "
        "for --load-format dummy)",
    )
    mk.add_argument(
        "--chat-template",
        choices=templates,
        default=None,
        help="the chat template written (default: the preset family's: qwen3-next-instruct, "
        "qwen3.5, nemotron-3-nano or granite-4.0; hybrid_serve/make_model/chat_templates.py)",
    )
    mk.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json, generation_config.json and the tokenizer but no weights (bf16 "
        "config), for --load-format dummy; the way to get a real-shape model (qwen3.5-*, "
        "qwen3-next-80b-a3b)",
    )


def _add_mtp_args(mk: argparse.ArgumentParser) -> None:
    """The multi-token-prediction head and its fitting."""
    mk.add_argument(
        "--mtp",
        action="store_true",
        help="add the multi-token-prediction head (one layer: Qwen's mtp.* with config "
        "mtp_num_hidden_layers 1; NemotronH's and Ling-3's with num_nextn_predict_layers 1), "
        "drawn after the other weights, which stay as without it",
    )
    mk.add_argument(
        "--fit-mtp",
        action="store_true",
        help="implies --mtp; then fit the head to the written main model (greedy continuations "
        "of random prompts, CPU training) and rewrite its mtp.* tensors; logs the accept rate "
        "before and after (hybrid_serve/make_model/mtp_fitting.py)",
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


def _add_training_args(mk: argparse.ArgumentParser) -> None:
    """Training the written model on text (`--train-text`)."""
    mk.add_argument(
        "--train-text",
        default=None,
        help="train the written model on this text before anything else (GSM8K .jsonl or plain "
        "text; transformers' model class, AdamW on fp32 weights) so its predictions have real "
        "margins (make_model/train_text.py); with --fit-mtp the head is fitted to the trained "
        "model on prompts cut from the same text",
    )
    mk.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="--train-text: wall-clock budget (default 5, or none with --train-steps)",
    )
    mk.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="--train-text: stop after this many steps (with --train-minutes: whichever first)",
    )
    mk.add_argument("--train-batch", type=int, default=4, help="--train-text: windows per step")
    mk.add_argument(
        "--train-seq-len", type=int, default=256, help="--train-text: tokens per window"
    )
    mk.add_argument("--train-lr", type=float, default=2e-3, help="--train-text: peak learning rate")
    mk.add_argument(
        "--train-precision",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="--train-text: the forward's arithmetic; bfloat16 runs it under CPU autocast "
        "(fp32 master weights and optimizer); auto: bfloat16 where the CPU has avx512_bf16 or "
        "AMX, else float32",
    )
