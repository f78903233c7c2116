"""Speculative decoding (NEXTN with the checkpoint's MTP head): greedy outputs equal plain
decoding in every scheduler mode, whatever the drafts; a rejected draft leaves exactly the state
plain decoding leaves; sampled requests decode beside drafted ones unchanged; pools stay clean.

The tiny preset's head is random, so it drafts almost nothing right; `override_drafts`
(controlled acceptance, `benchmarks/speculative.py`) replaces its drafts with the plain run's
own continuation, a share of it corrupted, so that every round accepts some drafts and rejects
others."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.speculative import override_drafts
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.debug import FAULT_ENV
from hybrid_serve.scheduler.engine import Engine
from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.sampling_params import SamplingParams
from tests.scheduler.helpers import FixedCosts

NEW = 14
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
POOLS = {"max_running_requests": 8, "max_total_tokens": 4096}
# every batch size speculates here (the default stops above 2 running requests)
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3,
        "speculative_disable_by_batch_size": 0}  # fmt: skip
# drafting costs nothing: every drafting request drafts N whatever it kept (the draft-length
# policy never reads this CPU's timings in a test; tests/scheduler/test_spec_policy.py)
FREE = FixedCosts(lambda batch: 1.0, lambda rows, batch: 1.0, lambda rows: 0.0)


# a top-2 logit gap under this is a tie (shared/reference/cpu-anchors.md, "near-ties"): there the
# plain run's pick follows the summation order, so no equality with it can rest on that token
TIE = 1e-4


def plain_greedy(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The plain engine's greedy continuations of `prompts`, each pick checked to beat its
    runner-up by TIE or more (the top-2 prompt logprobs of a prefill of prompt + continuation):
    a near-tie fails here, naming the checkpoint's seed as the thing to change."""
    plain = Engine(path, **POOLS)
    outs = [o["output_ids"] for o in plain.generate(prompts, {**GREEDY, "max_new_tokens": max_new})]
    top2 = {**GREEDY, "max_new_tokens": 1, "return_logprob": True, "top_logprobs_num": 2}
    for p, out in zip(prompts, outs, strict=True):
        meta = plain.generate(p + out, {**top2, "logprob_start_len": len(p) - 1})["meta_info"]
        for i, ((first, a), (_, b)) in enumerate(meta["input_top_logprobs"][1:]):
            assert first == out[i] and a - b >= TIE, (
                f"near-tie at token {i} after a {len(p)}-token prompt (gap {a - b:.1e}): "
                "give the test checkpoint another seed"
            )
    return outs


def spec_engine(path: str, costs=FREE, **options) -> Engine:
    engine = Engine(path, **options)
    engine.scheduler.forward.policy.costs = costs
    return engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    config = {**preset_config("tiny"), "mtp_num_hidden_layers": 1}
    path = str(write_checkpoint(tmp_path_factory.mktemp("tiny_mtp"), config, seed=6))
    gen = torch.Generator().manual_seed(4)
    vocab = config["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (6, 19, 70, 11, 33)]
    return path, prompts, plain_greedy(path, prompts, 40), vocab


def controlled(engine: Engine, prompts, expected, vocab: int, p_bad: float, seed: int = 0):
    """Drafts = the plain run's next tokens, each wrong with probability p_bad."""
    rng = random.Random(seed)
    known = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    spec = engine.scheduler.forward

    def override(req: Req, drafts: list[int]) -> list[int]:
        done = len(req.output_ids)
        cont = known.get(tuple(req.prompt_ids), [])[done : done + 3]
        return [t if rng.random() >= p_bad else (t + 1) % vocab for t in cont] or drafts

    override_drafts(spec, override)
    return spec


MODES = {
    "no-radix": {"disable_radix_cache": True},
    "no_buffer": {},
    "extra_buffer": {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 4},
    "extra_buffer_lazy": {
        "mamba_scheduler_strategy": "extra_buffer_lazy",
        "mamba_track_interval": 4,
    },
    "chunked": {"chunked_prefill_size": 16},
    "host-tier": {"enable_hierarchical_cache": True, "mamba_scheduler_strategy": "extra_buffer"},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_plain_decoding(ckpt, mode):
    path, prompts, expected, vocab = ckpt
    engine = spec_engine(path, **POOLS, **SPEC, **MODES[mode])
    # the head's own drafts (random weights: mostly rejected), one request at a time
    for p, e in zip(prompts[:2], expected, strict=False):
        assert engine.generate(p, GREEDY)["output_ids"] == e[:NEW]
    # controlled acceptance, batched: accepted and rejected drafts in every round
    for p_bad in (0.0, 0.3, 0.7):
        spec = controlled(engine, prompts, expected, vocab, p_bad)
        spec.rounds = spec.accepted = 0
        outs = engine.generate(prompts, GREEDY)
        assert [o["output_ids"] for o in outs] == [e[:NEW] for e in expected], p_bad
        assert spec.accepted > 0
        if p_bad == 0.0:  # every draft right: 4 tokens per round but where max_tokens cut
            assert spec.accepted >= 2 * spec.rounds
        assert engine.leak_report() == []
    # the same prompts again hit the cache (whole prompts, or their chunk-aligned states)
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 40})
    assert [o["output_ids"] for o in outs] == expected
    assert engine.leak_report() == []
    if "disable_radix_cache" not in MODES[mode]:
        assert engine.scheduler.tree.sanity_check() is None


@pytest.mark.parametrize("max_new", [1, 2, 5, 9])
def test_max_tokens_and_stop_tokens_landing_mid_draft(ckpt, max_new):
    path, prompts, expected, vocab = ckpt
    engine = spec_engine(path, **POOLS, **SPEC)
    controlled(engine, prompts, expected, vocab, 0.0)
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": max_new})
    assert [o["output_ids"] for o in outs] == [e[:max_new] for e in expected]
    # a stop token inside an accepted draft ends the request on it
    stop = expected[2][6]
    out = engine.generate(prompts[2], {**GREEDY, "stop_token_ids": [stop]})
    assert out["output_ids"] == expected[2][: expected[2].index(stop) + 1]
    assert out["meta_info"]["finish_reason"] == "stop"
    assert engine.leak_report() == []
    # drafts never reach past the context (here sized to the request, as `generate` does)
    tight = len(prompts[0]) + max_new + 1
    engine = spec_engine(
        path, max_running_requests=1, max_total_tokens=tight, max_context_len=tight, **SPEC
    )
    controlled(engine, prompts, expected, vocab, 0.0)
    out = engine.generate(prompts[0], {**GREEDY, "max_new_tokens": max_new})
    assert out["output_ids"] == expected[0][:max_new]
    # every draft right: each round lands 4 tokens, or what max_tokens leaves
    assert out["meta_info"].get("spec_verify_ct", 0) == -(-(max_new - 1) // 4)
    assert engine.leak_report() == []


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_draft_head_changes_drafts_not_outputs(ckpt, method):
    """--speculative-draft-model-quantization: the head's matrices and its own LM head copy
    are quantized; the main model is untouched and the tokens are plain decoding's."""
    path, prompts, expected, vocab = ckpt
    engine = spec_engine(path, **POOLS, **SPEC, speculative_draft_model_quantization=method)
    model = engine.runner.model
    dtype = {"int8": torch.int8, "int4": torch.uint8}[method]
    assert model.mtp.lm_head.weight.dtype == dtype and model.mtp.fc.weight.dtype == dtype
    assert model.lm_head.weight.dtype == torch.float32
    outs = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == [e[:NEW] for e in expected]
    assert engine.leak_report() == []


def test_large_batches_decode_plainly(ckpt):
    """--speculative-disable-by-batch-size 2: while more than two requests run, steps decode
    plainly; the two longest then speculate. Tokens are plain decoding's either way. The
    default limit is 2."""
    path, prompts, expected, vocab = ckpt
    engine = spec_engine(path, **POOLS, **{**SPEC, "speculative_disable_by_batch_size": 2})
    controlled(engine, prompts, expected, vocab, 0.0)
    lens = [3, 5, 6, 30, 40]
    params = [{**GREEDY, "max_new_tokens": n} for n in lens]
    outs = engine.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == [e[:n] for e, n in zip(expected, lens, strict=True)]
    rounds = [o["meta_info"].get("spec_verify_ct", 0) for o in outs]
    assert rounds[:3] == [0, 0, 0] and min(rounds[3:]) > 0, rounds
    assert engine.leak_report() == []
    assert RunnerConfig().speculative_disable_by_batch_size == 2


def test_rejected_draft_leaves_the_plain_decode_state(ckpt):
    """Drive both schedulers by hand: after a round whose second draft is wrong, the running
    Mamba slot (every layer's conv window and recurrent state) and the KV of the kept positions
    equal those of plain decoding at the same length, and the KV past them is back in the pool."""
    path, prompts, expected, vocab = ckpt
    plain, spec = Engine(path, **POOLS), spec_engine(path, **POOLS, **SPEC)
    prompt, cont = prompts[1], expected[1]
    reqs = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        req = Req(name, list(prompt), SamplingParams(**GREEDY))
        engine.scheduler.add_request(req)
        engine.scheduler.step()  # prefill: the first token
        reqs[name] = req
    sd = spec.scheduler.forward
    override_drafts(sd, lambda req, drafts: [cont[1], (cont[2] + 1) % vocab, cont[3]])
    free_before = spec.runner.kv_pool.available()
    spec.scheduler.step()  # lands cont[1] (accepted), cont[2] (the target's, not the draft)
    assert reqs["spec"].output_ids == cont[:3]
    assert spec.runner.kv_pool.available() == free_before - 2  # positions of cont[0], cont[1]
    plain.scheduler.step()
    plain.scheduler.step()
    a, b = reqs["plain"], reqs["spec"]
    assert a.output_ids == b.output_ids and a.kv_len == b.kv_len == len(prompt) + 2
    pa, pb = plain.runner.mamba_pool, spec.runner.mamba_pool
    torch.testing.assert_close(pb.conv_state[:, b.mamba_slot], pa.conv_state[:, a.mamba_slot])
    torch.testing.assert_close(
        pb.ssm_state[:, b.mamba_slot], pa.ssm_state[:, a.mamba_slot], atol=1e-5, rtol=1e-5
    )
    rows = [e.runner.req_pool.req_to_token[r.req_slot, : r.kv_len].long() for e, r in
            ((plain, a), (spec, b))]  # fmt: skip
    for layer in range(plain.runner.kv_pool.num_layers):  # the main model's attention layers
        ka = plain.runner.kv_pool.get_kv(layer)[0][rows[0]]
        kb = spec.runner.kv_pool.get_kv(layer)[0][rows[1]]
        torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-5)
    seen = []  # drafts asked for next: N, drafting being free here

    def asked(req: Req, drafts: list[int]) -> list[int]:
        seen.append(len(drafts))
        return cont[len(req.output_ids) :][: len(drafts)]

    override_drafts(sd, asked)
    for engine in (plain, spec):
        while engine.scheduler.has_work():
            engine.scheduler.step()
    assert a.output_ids == b.output_ids == cont[:NEW]
    assert seen == [3, 3, 2], seen  # the last cut by max_tokens
    assert plain.leak_report() == [] and spec.leak_report() == []


def test_penalised_and_logprob_requests_decode_beside_drafted_ones(ckpt):
    """Penalties do not draft, logprob requests draft greedily; in the same batch as other
    drafters they give what plain decoding gives, logprobs included. A seeded sampled request
    drafts too (rejection sampling, its draws from its own generator): the same batch on a
    fresh engine gives the same tokens."""
    path, prompts, expected, vocab = ckpt
    sampled = {"max_new_tokens": NEW, "temperature": 0.8, "seed": 7}
    others = [
        {"max_new_tokens": NEW, "temperature": 0.0, "frequency_penalty": 0.5},
        {"max_new_tokens": NEW, "temperature": 0.0, "return_logprob": True, "top_logprobs_num": 2},
    ]
    params = [GREEDY, sampled, *others, {**GREEDY, "return_logprob": True}]
    plain = Engine(path, **POOLS).generate(prompts, params)
    runs = [spec_engine(path, **POOLS, **SPEC).generate(prompts, params) for _ in range(2)]
    outs = runs[0]
    assert (
        outs[1]["output_ids"] == runs[1][1]["output_ids"] and outs[1]["meta_info"]["spec_verify_ct"]
    )
    for i, (o, p) in enumerate(zip(outs, plain, strict=True)):
        if i == 1:
            continue
        assert o["output_ids"] == p["output_ids"]
        lp, lq = (r["meta_info"].get("output_token_logprobs") for r in (o, p))
        if lq:
            assert [t for _, t, *_ in lp] == [t for _, t, *_ in lq]
            got, want = (torch.tensor([v for v, *_ in x]) for x in (lp, lq))
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_speculative_sampling_keeps_the_target_distribution(ckpt):
    """Three sampled tokens (temperature 0.7 over the top 2) from 600 seeds, drafts kept or
    replaced by rejection sampling: the empirical distribution of the 8 possible sequences is
    within 0.1 (total variation) of the exact one from transformers' logits; drafts were both
    kept and refused. Always keeping the (greedy) drafts would put all mass on one sequence."""
    from transformers import AutoModelForCausalLM

    path, prompts, expected, vocab = ckpt
    prompt, temp = prompts[0], 0.7
    params = {"max_new_tokens": 3, "temperature": temp, "top_k": 2, "ignore_eos": True}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def top2(ids: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        vals, toks = logits.topk(2)
        return list(zip(toks.tolist(), torch.softmax(vals / temp, -1).tolist(), strict=True))

    exact: dict[tuple[int, ...], float] = {}
    for a, pa in top2(prompt):
        for b, pb in top2([*prompt, a]):
            for c, pc in top2([*prompt, a, b]):
                exact[(a, b, c)] = pa * pb * pc
    engine = spec_engine(path, max_running_requests=64, max_total_tokens=8192, **SPEC)
    controlled(engine, [prompt], [expected[0]], vocab, 0.0)  # greedy drafts: q a point mass
    n = 600
    outs = engine.generate([prompt] * n, [{**params, "seed": s} for s in range(n)])
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o["output_ids"])] = counts.get(tuple(o["output_ids"]), 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in exact.items())
    assert tv < 0.1, (tv, counts, exact)
    spec = engine.scheduler.forward
    assert 0 < spec.accepted < spec.drafted
    assert engine.leak_report() == []


def test_sessions_continue_from_the_accepted_state(ckpt):
    path, prompts, expected, vocab = ckpt
    engines = [Engine(path, **POOLS), spec_engine(path, **POOLS, **SPEC)]
    controlled(engines[1], prompts, expected, vocab, 0.3)
    outs = []
    for engine in engines:
        sid = engine.open_session(capacity_of_str_len=1000)
        rid, turns = None, []
        for new in (prompts[0], prompts[3], prompts[1]):
            out = engine.generate(new, GREEDY, session_params={"id": sid, "rid": rid})
            turns.append(out["output_ids"])
            rid = out["meta_info"]["id"]
        outs.append(turns)
        assert engine.close_session(sid)
        assert engine.leak_report() == []
    assert outs[0] == outs[1]


@pytest.mark.parametrize("fault", ["step:bad@2", "step:bad@5"])
def test_a_fault_while_landing_drafts_fails_only_that_request(ckpt, monkeypatch, fault):
    path, prompts, expected, vocab = ckpt
    monkeypatch.setenv(FAULT_ENV, fault)
    engine = spec_engine(path, **POOLS, **SPEC)
    controlled(engine, prompts, expected, vocab, 0.0)
    sched = engine.scheduler
    reqs = [
        Req(r, p, SamplingParams(**GREEDY))
        for r, p in zip(["a", "bad-1", "b"], prompts[:3], strict=True)
    ]
    for req in reqs:
        sched.add_request(req)
    for _ in range(100):
        if not sched.has_work():
            break
        sched.step()
    assert reqs[1].error is not None
    assert [reqs[0].output_ids, reqs[2].output_ids] == [expected[0][:NEW], expected[2][:NEW]]
    assert engine.leak_report() == []


def test_aborted_mid_generation_frees_everything(ckpt):
    path, prompts, expected, vocab = ckpt
    engine = spec_engine(path, **POOLS, **SPEC)
    controlled(engine, prompts, expected, vocab, 0.3)
    sched = engine.scheduler
    req = Req("x", prompts[2], SamplingParams(**GREEDY))
    sched.add_request(req)
    for _ in range(3):
        sched.step()
    assert len(req.output_ids) > 3
    sched.abort("x")
    assert engine.leak_report() == []


@pytest.mark.parametrize(
    "options, message",
    [
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm must be one of NEXTN"),
        ({**SPEC, "speculative_eagle_topk": 2}, "only 1"),
        ({**SPEC, "speculative_num_draft_tokens": 3}, "--speculative-num-steps + 1"),
        ({**SPEC, "page_size": 4}, "--page-size 1"),
        ({"speculative_num_steps": 2}, "needs --speculative-algorithm"),
        ({**SPEC, "speculative_draft_model_quantization": "fp8"}, "must be one of int8, int4"),
        (
            {**SPEC, "speculative_draft_model_quantization": "int8", "quantization": "int4"},
            "with --quantization must be the same format",
        ),
        (
            {**SPEC, "speculative_draft_model_quantization": "int8", "device": "cuda"},
            "--speculative-draft-model-quantization int8 runs on the CPU only",
        ),
    ],
)
def test_bad_flags_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        RunnerConfig(**options)


def test_a_checkpoint_without_a_head_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "nohead", preset_config("tiny"), seed=1)
    with pytest.raises(ValueError, match="no MTP head"):
        Engine(str(path), **POOLS, **SPEC)


@pytest.mark.gpu
def test_greedy_equals_plain_decoding_on_cuda(ckpt):
    """On CUDA (Triton kernels; the verify runs eagerly, the decode steps in CUDA graphs)."""
    path, prompts, expected, vocab = ckpt
    plain = Engine(path, device="cuda", **POOLS).generate(prompts, GREEDY)
    engine = spec_engine(path, device="cuda", **POOLS, **SPEC)
    controlled(engine, prompts, expected, vocab, 0.3)
    outs = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == [p["output_ids"] for p in plain]
    assert engine.scheduler.forward.accepted > 0
    assert engine.leak_report() == []
