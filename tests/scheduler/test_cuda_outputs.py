"""On CUDA: prompt logprobs (cache on, chunked or not) equal transformers' on CPU, grammar masks
and logit_bias / min_new_tokens act on CUDA logits. (`gpu`-marked: skipped without CUDA; run
by tests/gpu_check.sh's `-m gpu` step.)"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "pet": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["pet", "n"],
}


@pytest.mark.parametrize("chunk", [0, 16])
def test_prompt_logprobs_grammar_and_bias_on_cuda(tmp_path, chunk):
    path = write_checkpoint(tmp_path, preset_config("tiny"), seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(3, 2000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    engine = Engine(
        str(path),
        device="cuda",
        max_running_requests=8,
        max_total_tokens=4096,
        chunked_prefill_size=chunk,
        dtype="float32",
    )
    engine.generate(prompt + [5, 6], {"max_new_tokens": 2, "temperature": 0})  # cache it
    params = {"max_new_tokens": 3, "temperature": 0, "return_logprob": True}
    out = engine.generate(prompt, {**params, "logprob_start_len": 0})
    got = [x[0] for x in out["meta_info"]["input_token_logprobs"][1:]]
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-3)  # TF32-free fp32 on GPU: well inside this
    assert out["meta_info"]["cached_tokens"] == 0
    sampling = [
        {"max_new_tokens": 60, "temperature": 1.0, "seed": s, "json_schema": json.dumps(SCHEMA)}
        for s in range(6)
    ]
    for o in engine.generate([[5, 6, 7]] * 6, sampling):
        obj = json.loads(engine.tokenizer.decode(o["output_ids"], skip_special_tokens=True))
        assert obj["pet"] in ("cat", "dog") and 0 <= obj["n"] <= 9
    forced = {"max_new_tokens": 5, "temperature": 0, "min_new_tokens": 2, "stop_token_ids": [7]}
    o = engine.generate([5, 6, 7], {**forced, "logit_bias": {7: 100.0}})
    assert o["output_ids"][2] == 7 and 7 not in o["output_ids"][:2] and len(o["output_ids"]) == 3
    assert engine.leak_report() == []
