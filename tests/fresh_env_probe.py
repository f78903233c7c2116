"""Run by tests/test_fresh_install.py inside its scratch environment, from a copy outside the
checkout (so only installed packages import): in one process, transformers' NemotronH and
`hybrid_serve.kernels` beside Hugging Face's `kernels`, then one parity check of the `tiny`
preset (Qwen3-Next) against transformers. Prints one JSON object of what it found; the test
judges it.

    python fresh_env_probe.py WORK_DIR      (the checkpoint is written under WORK_DIR)
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import sys
import sysconfig
from pathlib import Path

PRESET = "tiny"
CHECKPOINT_SEED = 1
PROMPT_SEED = 7
PROMPT_LEN = 12
NEW_TOKENS = 8


def imports() -> dict[str, str]:
    """Where each module came from, and which distribution's files those are."""
    import kernels
    from transformers.models.nemotron_h import modeling_nemotron_h

    import hybrid_serve.kernels

    def owned_by(distribution: str, relative: str) -> str:
        return str(importlib.metadata.distribution(distribution).locate_file(relative))

    return {
        "site_packages": sysconfig.get_paths()["purelib"],
        "kernels": kernels.__file__,
        "kernels_distribution_file": owned_by("kernels", "kernels/__init__.py"),
        "hybrid_serve.kernels": hybrid_serve.kernels.__file__,
        "hybrid_serve_distribution_file": owned_by(
            "hybrid-serve", "hybrid_serve/kernels/__init__.py"
        ),
        "NemotronHForCausalLM": modeling_nemotron_h.NemotronHForCausalLM.__qualname__,
    }


def parity(work: Path) -> dict[str, object]:
    """Our model and transformers' on one checkpoint of the preset and one short prompt: our
    last-token fp32 logits against transformers' in float64 (the exact result) and in fp32,
    and NEW_TOKENS greedy tokens of each."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid_serve.make_model.presets import preset_config, write_checkpoint
    from hybrid_serve.models.loader import load_model
    from hybrid_serve.scheduler.model_runner import (
        DecodeInput,
        ExtendInput,
        ModelRunner,
        RunnerConfig,
    )

    torch.set_num_threads(1)
    config = preset_config(PRESET)
    path = write_checkpoint(work / PRESET, config, seed=CHECKPOINT_SEED)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    exact = copy.deepcopy(hf).double()
    exact.config._experts_implementation = "eager"  # torch's grouped GEMM has no float64 kernel
    ours = load_model(path, dtype="float32")

    gen = torch.Generator().manual_seed(PROMPT_SEED)
    # ids 0-2 are the preset's special tokens
    prompt = torch.randint(3, config["vocab_size"], (PROMPT_LEN,), generator=gen).tolist()
    ids = torch.tensor([prompt])

    runner = ModelRunner(ours, RunnerConfig(max_running_requests=2, max_total_tokens=256))
    (req,) = runner.req_pool.alloc(1)
    (slot,) = runner.mamba_pool.alloc(1).tolist()
    loc = runner.alloc_kv(req, 0, len(prompt))
    logits = runner.forward(runner.build_prefill([ExtendInput(req, slot, 0, prompt)], [loc]))[0]
    tokens = [int(logits.argmax())]
    seq_len = len(prompt)
    for _ in range(NEW_TOKENS - 1):
        loc = runner.alloc_kv(req, seq_len, 1)
        step = runner.build_decode([DecodeInput(req, slot, seq_len, tokens[-1])], loc)
        tokens.append(int(runner.forward(step)[0].argmax()))
        seq_len += 1

    with torch.no_grad():
        ref64 = exact(ids).logits[0, -1]
        ref32 = hf(ids).logits[0, -1]
        generated = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,  # exactly NEW_TOKENS tokens
        )
    return {
        "prompt": prompt,
        "max_dlogit_float64": (logits.double() - ref64).abs().max().item(),
        "max_dlogit_fp32": (logits - ref32).abs().max().item(),
        "ours": tokens,
        "transformers": generated[0, len(prompt) :].tolist(),
    }


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    found = {"imports": imports(), "parity": parity(work)}
    sys.stdout.write(json.dumps(found) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
