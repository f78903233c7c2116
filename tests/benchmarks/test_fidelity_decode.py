"""`benchmarks.decode_kl` and fidelity's `--kl-path decode` on the tiny preset: fp32's decode
path against itself is exactly KL 0 with top-1 1.0, lines up with the teacher-forced
positions and reproduces the Engine's greedy tokens; a lossy mode (bf16 products) diverges."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.decode_kl import divergence, forced_decode_logprobs, group_sizes
from benchmarks.fidelity import load_engine, main, teacher_forced

OPTS = dict(max_running_requests=8, max_context_len=256, max_total_tokens=2048)
LENGTHS = (5, 9, 3, 12, 7)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def fp32(tiny_ckpt):
    return load_engine(str(tiny_ckpt), "float32", OPTS)


@pytest.fixture(scope="module")
def greedy(fp32, prompts) -> list[list[int]]:
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    out = [r["output_ids"] for r in fp32.generate(prompts, sp)]
    fp32.flush_cache()
    return out


def test_group_sizes_cycle_and_end_with_the_rest():
    assert group_sizes(30, [8, 16]) == [8, 16, 6]
    assert group_sizes(5, [1, 3]) == [1, 3, 1]
    assert group_sizes(2, [4]) == [2]
    with pytest.raises(ValueError):
        group_sizes(3, [0])


def test_fp32_decode_path_against_itself_is_exact(fp32, prompts, greedy):
    graphs = fp32.scheduler.graph_runner
    with torch.inference_mode():
        first = forced_decode_logprobs(graphs, prompts, greedy, [1, 3])
        again = forced_decode_logprobs(graphs, prompts, greedy, [1, 3])
        forced = teacher_forced(fp32, prompts, greedy)
    assert [r.shape[0] for r in first] == [NEW_TOKENS - 1] * len(prompts)
    kl, agree = divergence(torch.cat(first), torch.cat(again))
    assert kl.abs().max().item() == 0.0 and bool(agree.all())
    for row, out, tf in zip(first, greedy, forced, strict=True):
        assert row.argmax(-1).tolist() == out[1:]  # the Engine's own greedy continuation
        torch.testing.assert_close(row, tf[1:], atol=1e-3, rtol=0)  # same positions
    assert fp32.leak_report() == []  # every group's slots went back


def test_a_lossy_mode_diverges_on_the_decode_path(tiny_ckpt, fp32, prompts, greedy):
    bf16 = load_engine(str(tiny_ckpt), "bf16-products", OPTS)
    with torch.inference_mode():
        ref = forced_decode_logprobs(fp32.scheduler.graph_runner, prompts, greedy, [2])
        got = forced_decode_logprobs(bf16.scheduler.graph_runner, prompts, greedy, [2])
    kl, agree = divergence(torch.cat(ref), torch.cat(got))
    assert bool(torch.isfinite(kl).all()) and kl.mean().item() > 0.0
    assert kl.min().item() > -1e-9  # a KL, up to rounding
    assert agree.numel() == len(prompts) * (NEW_TOKENS - 1)
    with pytest.raises(ValueError, match="one length"):
        forced_decode_logprobs(fp32.scheduler.graph_runner, prompts, [[1, 2], [3]] * 3, [2])


def test_fidelity_reports_both_paths(tiny_ckpt, gsm8k_dir, tmp_path):
    out = tmp_path / "fidelity.json"
    main(
        [
            *("--model-path", str(tiny_ckpt), "--data-path", str(gsm8k_dir)),
            *("--num-prompts", "4", "--max-new-tokens", "4", "--threads", "1"),
            *("--modes", "bf16-products", "--max-running-requests", "4"),
            *("--kl-path", "teacher-forced,decode", "--decode-batch-sizes", "1,3"),
            *("--json-out", str(out)),
        ]
    )
    report = json.loads(out.read_text())
    assert report["decode_path"]["batch_sizes"] == [1, 3]
    assert report["decode_path"]["float32_top1_is_its_greedy_output"] == 1.0
    mode = report["bf16-products"]
    assert mode["positions"] == 4 * 4 and mode["kl_mean"] > 0.0  # teacher-forced
    dec = mode["decode_path"]
    assert dec["positions"] == 4 * 3 and dec["kl_mean"] > 0.0
    assert [b["rows"] for b in dec["by_batch"]] == [1, 3]
    assert dec["teacher_forced_same_positions"]["kl_mean"] > 0.0
