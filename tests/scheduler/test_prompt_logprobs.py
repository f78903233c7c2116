"""Prompt logprobs (SGLang's `logprob_start_len` / `input_token_logprobs`): equal to
transformers' log_softmax on the same positions within 1e-4 (fp32), with the radix cache on
(a cached prefix has no logits: the request recomputes from logprob_start_len) and off, chunked
or not, inside a session turn; a start past the prompt is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.session import SessionError

TOL = 1e-4
POOLS = {"max_running_requests": 4, "max_total_tokens": 2048}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(9)
    vocab = preset_config("tiny")["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    return str(path), hf, rand


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is log p(. | ids[:p+1])."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(meta: dict, ids: list[int], ref: torch.Tensor, start: int, k: int = 0) -> None:
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[start:]
    assert got[0][0] is None  # no logits predict the first requested token
    want = [ref[p - 1, ids[p]].item() for p in range(start + 1, len(ids))]
    assert [lp for lp, _, _ in got[1:]] == pytest.approx(want, abs=TOL)
    if k:
        tops = meta["input_top_logprobs"]
        assert tops[0] is None and len(tops) == len(got)
        for p, row in zip(range(start + 1, len(ids)), tops[1:], strict=True):
            vals, _ = ref[p - 1].topk(k)
            # the i-th token is one whose reference logprob is the i-th largest: tokens within
            # TOL of each other (near-ties) may come in either order
            assert [ref[p - 1, t].item() for t, _ in row] == pytest.approx(vals.tolist(), abs=TOL)
            assert len({t for t, _ in row}) == k
            assert [lp for _, lp in row] == pytest.approx(vals.tolist(), abs=TOL)


MODES = {
    "radix": {},
    "radix-chunk-16": {"chunked_prefill_size": 16},
    "extra-buffer": {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 4},
    "radix-off": {"disable_radix_cache": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_logprobs_equal_transformers(ckpt, mode):
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS, **MODES[mode])
    prompt = rand(40)
    ref = hf_prompt_logprobs(hf, prompt)
    greedy = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    # warm the radix cache with the whole prompt (and more), so a hit would skip the logits
    engine.generate(prompt + rand(5), greedy)
    for start, k in ((0, 3), (17, 0), (len(prompt) - 1, 0)):
        params = {**greedy, "return_logprob": True, "logprob_start_len": start}
        params["top_logprobs_num"] = k
        out = engine.generate(prompt, params)
        check(out["meta_info"], prompt, ref, start, k)
        # from the last position on no prompt logits are needed: an exact repeat hits it all
        limit = len(prompt) if start == len(prompt) - 1 else start
        assert out["meta_info"]["cached_tokens"] <= limit
        # the output logprobs are unchanged by the recompute
        last = out["meta_info"]["output_token_logprobs"][0]
        assert last[0] == pytest.approx(ref[-1, last[1]].item(), abs=TOL)
    default = engine.generate(prompt, {**greedy, "return_logprob": True})  # -1: last token
    assert default["meta_info"]["input_token_logprobs"] == [[None, prompt[-1], None]]
    with pytest.raises(ValueError, match="past the prompt"):
        engine.generate(prompt, {**greedy, "return_logprob": True, "logprob_start_len": 40})
    assert engine.leak_report() == []


def test_prompt_logprobs_in_a_session_turn(ckpt):
    """A turn that asks for logprobs inside the held tokens does not take the held slot."""
    path, hf, rand = ckpt
    engine = Engine(path, **POOLS)
    sid = engine.open_session()
    greedy = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    p1, p2 = rand(12), rand(6)
    t1 = engine.generate(p1, greedy, session_params={"id": sid})
    context = p1 + t1["output_ids"] + p2
    params = {**greedy, "return_logprob": True, "logprob_start_len": 4}
    t2 = engine.generate(p2, params, session_params={"id": sid, "rid": t1["meta_info"]["id"]})
    check(t2["meta_info"], context, hf_prompt_logprobs(hf, context), 4)
    with pytest.raises(SessionError):
        params["logprob_start_len"] = len(context) + 10
        engine.generate(p2, params, session_params={"id": sid, "rid": t1["meta_info"]["id"]})
    engine.close_session(sid)
    assert engine.leak_report() == []
