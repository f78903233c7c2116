"""A Qwen3.5 MoE checkpoint in the vision-language release layout served over HTTP (radix cache
on, extra_buffer): greedy tokens equal transformers' on the text-only twin, before and after the
prefix is cached, and the leak check is clean."""

from __future__ import annotations

import httpx
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from tests.hf_reference import hf_greedy
from tests.server.conftest import serve_command, start, wait_idle_and_clean


def test_multimodal_qwen3_5_moe_over_http(tmp_path):
    cfg = preset_config("tiny-qwen3.5-moe")
    text = write_checkpoint(tmp_path / "text", cfg, seed=6)
    wrapped = write_checkpoint(tmp_path / "vl", cfg, seed=6, multimodal=True)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 2048, (100,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (4, 20)]
    hf = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, 8)
    srv = start(
        serve_command(
            wrapped,
            "--context-length",
            "512",
            "--max-running-requests",
            "4",
            "--mamba-scheduler-strategy",
            "extra_buffer",
        ),
        tmp_path / "server.log",
    )
    try:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            for _ in range(2):  # the second round hits the cached shared prefix
                for p, exp in zip(prompts, expected, strict=True):
                    body = {
                        "input_ids": p,
                        "sampling_params": {
                            "max_new_tokens": 8,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    }
                    out = http.post("/generate", json=body).json()
                    assert out["output_ids"] == exp
            assert out["meta_info"]["cached_tokens"] >= 64
            assert wait_idle_and_clean(http)["problems"] == []
    finally:
        assert srv.stop() == 0
