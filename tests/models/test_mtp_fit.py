"""Fitting the MTP head (`make-model --fit-mtp`: `make_model.mtp_fitting` runs the pass,
`make_model.mtp_training` trains the head).

The trainable twin equals the served head before training (MoE and dense heads); fitting raises
the held-out accept rate far above the random head's on a main model whose next token a head
can learn (a preset drawn with a tiny init range: its layers barely move the residual stream, so
the next token follows the current one). The presets' own random models are chaotic (one token
changed anywhere in the context changes the next greedy token), so there a fitted head learns
its training sequences and nothing that carries over: the CLI test asserts only the machinery.
The rewritten checkpoint loads, every other tensor and file is unchanged, and block-FP8 and
sharded checkpoints round-trip.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybrid_serve.make_model.mtp_fitting import fit_checkpoint, greedy_data
from hybrid_serve.make_model.mtp_training import TrainableHead, accept_rate, write_head
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import checkpoint_files, load_model
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.model_runner import ExtendInput, ModelRunner
from hybrid_serve.server.cli import main as cli_main


def _with_mtp(name: str) -> dict:
    return {**preset_config(name), "mtp_num_hidden_layers": 1}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})  # noqa: SIM118
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (dtype, shape and bytes; NaN-safe)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3.5"])
def test_trainable_head_equals_the_served_head(preset, tmp_path) -> None:
    """Two sequences of 12 rows: the twin's logits against `mtp_hidden` over one extend batch
    plus `draft_logits` (the served path, KV pool and all)."""
    model = load_model(write_checkpoint(tmp_path, _with_mtp(preset), seed=3), "float32", mtp=True)
    gen = torch.Generator().manual_seed(0)
    B, T, c = 2, 12, model.config
    tokens = torch.randint(3, c.vocab_size, (B, T), generator=gen)
    hidden = torch.randn(B, T, c.hidden_size, generator=gen)
    runner = ModelRunner(model, RunnerConfig(max_running_requests=B, max_total_tokens=64))
    reqs, slots = runner.req_pool.alloc(B), runner.mamba_pool.alloc(B).tolist()
    items = [ExtendInput(r, m, 0, t.tolist()) for r, m, t in zip(reqs, slots, tokens, strict=True)]
    batch = runner.build_prefill(items, [runner.alloc_kv(r, 0, T) for r in reqs])
    served = model.draft_logits(model.mtp_hidden(batch, hidden.flatten(0, 1)))
    head = TrainableHead(model)
    twin = head.logits(head(tokens, hidden))
    torch.testing.assert_close(twin.flatten(0, 1), served, atol=1e-4, rtol=0)
    assert all(p.requires_grad for p in head.parameters())  # the main model's stay frozen
    assert {n.removeprefix("head.") for n, _ in head.named_parameters()} == {
        n for n, _ in model.mtp.named_parameters()
    }


def test_fitting_a_learnable_model_raises_the_held_out_accept_rate(tmp_path) -> None:
    path = write_checkpoint(tmp_path, _with_mtp("tiny"), seed=3, init_range=1e-3)
    before = _tensors(path)
    result = fit_checkpoint(path, steps=60, prompts=24, held_out=8, prompt_len=8, new_tokens=24)
    assert result.before < 0.02 and result.train_before < 0.02  # the random head
    assert result.after > 0.4 and result.train_after > 0.9, result
    assert result.steps == 60

    after = _tensors(path)
    assert after.keys() == before.keys()
    head = {n for n in before if n.startswith("mtp.")}
    assert all(_same(before[n], after[n]) for n in before.keys() - head)
    assert all(not torch.equal(before[n], after[n]) for n in head if n.endswith("proj.weight"))
    # the served head of the rewritten checkpoint drafts what the fit measured
    model = load_model(path, "float32", mtp=True)
    test = greedy_data(model, 32, 8, 24).split(24)[1]  # the held-out sequences again
    assert accept_rate(TrainableHead(model), test) == pytest.approx(result.after)


def test_block_fp8_sharded_head_is_requantized_in_place(tmp_path) -> None:
    path = write_checkpoint(
        tmp_path,
        _with_mtp("tiny"),
        seed=5,
        dtype=torch.bfloat16,
        fp8_block=(128, 128),
        max_shard_bytes=200_000,
    )
    index = (path / "model.safetensors.index.json").read_bytes()
    before = _tensors(path)
    model = load_model(path, "float32", mtp=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.mtp.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    wanted = {n: p.clone() for n, p in model.mtp.named_parameters()}
    names = write_head(path, model)

    assert (path / "model.safetensors.index.json").read_bytes() == index
    after = _tensors(path)
    assert set(names) == {n for n in before if n.startswith("mtp.")}
    assert any(n.endswith("_scale_inv") for n in names)
    assert all(_same(before[n], after[n]) for n in before.keys() - set(names))
    assert all(after[n].dtype == before[n].dtype for n in names)  # e4m3, fp32 scales, bf16
    reloaded = dict(load_model(path, "float32", mtp=True).mtp.named_parameters())
    for name, want in wanted.items():  # e4m3 rounding (3 mantissa bits) at most
        torch.testing.assert_close(
            reloaded[name], want, atol=0.07 * want.abs().max().item(), rtol=0
        )
    files = {f.name: f.read_bytes() for f in checkpoint_files(path)}
    write_head(path, load_model(path, "float32", mtp=True))  # the same numbers: the same bytes
    assert {f.name: f.read_bytes() for f in checkpoint_files(path)} == files


def test_cli_fit_mtp_rewrites_only_the_head(tmp_path, caplog) -> None:
    plain, fitted = tmp_path / "plain", tmp_path / "fitted"
    cli_main(["make-model", "--preset", "tiny", "--mtp", "--out", str(plain)])
    with caplog.at_level(logging.INFO):
        cli_main(
            ["make-model", "--preset", "tiny", "--fit-mtp", "--fit-steps", "10"]
            + ["--fit-prompts", "8", "--out", str(fitted)]
        )
    lines = [r.getMessage() for r in caplog.records if "fitted the MTP head" in r.getMessage()]
    assert len(lines) == 1 and "accept rate" in lines[0]
    a, b = _tensors(plain), _tensors(fitted)
    assert a.keys() == b.keys()
    assert all(_same(a[n], b[n]) for n in a if not n.startswith("mtp."))
    assert not torch.equal(a["mtp.fc.weight"], b["mtp.fc.weight"])
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (plain / name).read_bytes() == (fitted / name).read_bytes()
    assert load_model(fitted, mtp=True).mtp is not None


@pytest.mark.parametrize(
    "flags",
    [["--fit-mtp", "--config-only"], ["--mtp", "--fit-steps", "5"]],
)
def test_cli_refuses_bad_fit_flags_in_one_line(flags, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["make-model", "--preset", "tiny", *flags, "--out", str(tmp_path / "m")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-serve: error:") and err.count("\n") == 1
    assert not (tmp_path / "m").exists()
