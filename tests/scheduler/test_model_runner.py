"""ModelRunner bookkeeping: paged KV allocation, padded decode isolation, page-size invariance."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=5)
    return load_model(path, dtype="float32")


def _runner(model, page_size=1, **kw) -> ModelRunner:
    cfg = RunnerConfig(max_running_requests=4, max_total_tokens=512, page_size=page_size, **kw)
    return ModelRunner(model, cfg)


def test_alloc_kv_pages(model):
    r = _runner(model, page_size=4)
    req = r.req_pool.alloc(1)[0]
    locs = r.alloc_kv(req, 0, 6)  # pages for positions 0-3 and 4-7
    assert r.kv_pool.available() == r.kv_pool.size - 2
    assert (locs // 4).unique().numel() == 2 and 0 not in (locs // 4).tolist()
    more = r.alloc_kv(req, 6, 2)  # fills the second page: no new page
    assert r.kv_pool.available() == r.kv_pool.size - 2
    assert more.tolist() == [locs[4].item() + 2, locs[4].item() + 3]
    r.alloc_kv(req, 8, 1)  # position 8 starts a page
    assert r.kv_pool.available() == r.kv_pool.size - 3
    r.free_kv(req, 9)
    assert r.kv_pool.available() == r.kv_pool.size
    with pytest.raises(ValueError, match="exceeds the context"):
        r.alloc_kv(req, 0, r.config.max_context_len + 1)


def test_alloc_kv_short_returns_none(model):
    r = _runner(model)
    req = r.req_pool.alloc(1)[0]
    assert r.alloc_kv(req, 0, r.kv_pool.size + 1) is None
    assert r.kv_pool.available() == r.kv_pool.size


def _generate(r: ModelRunner, prompts, steps, pad_to=None):
    slots = [(r.req_pool.alloc(1)[0], int(r.mamba_pool.alloc(1)[0])) for _ in prompts]
    items = [ExtendInput(q, m, 0, p) for (q, m), p in zip(slots, prompts, strict=True)]
    locs = [r.alloc_kv(q, 0, len(p)) for (q, _), p in zip(slots, prompts, strict=True)]
    tokens = r.forward(r.build_prefill(items, locs)).argmax(-1).tolist()
    out, lens = [[t] for t in tokens], [len(p) for p in prompts]
    for _ in range(steps):
        dec = [DecodeInput(q, m, lens[i], tokens[i]) for i, (q, m) in enumerate(slots)]
        loc = torch.cat([r.alloc_kv(q, lens[i], 1) for i, (q, _) in enumerate(slots)])
        tokens = r.forward(r.build_decode(dec, loc, pad_to))[: len(slots)].argmax(-1).tolist()
        lens = [n + 1 for n in lens]
        for o, t in zip(out, tokens, strict=True):
            o.append(t)
    return out, slots


def test_page_size_does_not_change_tokens(model):
    prompts = [list(range(3, 40)), list(range(100, 105)), [7]]
    ref, _ = _generate(_runner(model), prompts, steps=10)
    paged, _ = _generate(_runner(model, page_size=4), prompts, steps=10)
    assert paged == ref


def test_padding_rows_never_touch_live_state(model):
    r = _runner(model)
    bystander = int(r.mamba_pool.alloc(1)[0])  # a live slot that is not in the batch
    r.mamba_pool.ssm_state[:, bystander].normal_()
    r.mamba_pool.conv_state[:, bystander].normal_()
    ssm = r.mamba_pool.ssm_state[:, bystander].clone()
    conv = r.mamba_pool.conv_state[:, bystander].clone()
    k_before = [k.clone() for k in r.kv_pool.k_buffer]
    padded, slots = _generate(r, [list(range(3, 20))], steps=6, pad_to=4)
    assert torch.equal(r.mamba_pool.ssm_state[:, bystander], ssm)
    assert torch.equal(r.mamba_pool.conv_state[:, bystander], conv)
    req = slots[0][0]
    live = set(r.req_pool.req_to_token[req, :23].tolist())
    for before, after in zip(k_before, r.kv_pool.k_buffer, strict=True):
        changed = set((before != after).any(-1).any(-1).nonzero().flatten().tolist())
        assert changed <= live | {0}, "a padding row wrote KV outside location 0"
    unpadded, _ = _generate(_runner(model), [list(range(3, 20))], steps=6)
    assert padded == unpadded


def test_prefill_tracks_chunk_aligned_states(model):
    """A tracked prefill leaves in the track slot exactly the states a prefill of the first
    `offset` tokens alone leaves (conv window and recurrent state), and changes nothing else."""
    torch.manual_seed(0)
    prompts = [torch.randint(3, 2000, (n,)).tolist() for n in (150, 70, 64)]
    offsets = [128, 64, 64]  # mid-prompt, mid-prompt, whole prompt
    r = _runner(model, mamba_cache_size=12)
    rows = [r.req_pool.alloc(1)[0] for _ in prompts]
    slots = r.mamba_pool.alloc(3).tolist()
    tracks = r.mamba_pool.alloc(3).tolist()
    items = [
        ExtendInput(q, m, 0, p, track_offset=off, track_slot=t)
        for q, m, p, off, t in zip(rows, slots, prompts, offsets, tracks, strict=True)
    ]
    locs = [r.alloc_kv(q, 0, len(p)) for q, p in zip(rows, prompts, strict=True)]
    logits = r.forward(r.build_prefill(items, locs))

    ref = _runner(model, mamba_cache_size=12)
    ref_rows = [ref.req_pool.alloc(1)[0] for _ in prompts]
    ref_slots = ref.mamba_pool.alloc(3).tolist()
    ref_items = [
        ExtendInput(q, m, 0, p[:off])
        for q, m, p, off in zip(ref_rows, ref_slots, prompts, offsets, strict=True)
    ]
    ref_locs = [ref.alloc_kv(q, 0, off) for q, off in zip(ref_rows, offsets, strict=True)]
    ref.forward(ref.build_prefill(ref_items, ref_locs))
    for t, m in zip(tracks, ref_slots, strict=True):
        torch.testing.assert_close(r.mamba_pool.conv_state[:, t], ref.mamba_pool.conv_state[:, m])
        torch.testing.assert_close(
            r.mamba_pool.ssm_state[:, t], ref.mamba_pool.ssm_state[:, m], atol=2e-5, rtol=0
        )
    plain = _runner(model, mamba_cache_size=12)
    p_rows = [plain.req_pool.alloc(1)[0] for _ in prompts]
    p_slots = plain.mamba_pool.alloc(3).tolist()
    p_items = [ExtendInput(q, m, 0, p) for q, m, p in zip(p_rows, p_slots, prompts, strict=True)]
    p_locs = [plain.alloc_kv(q, 0, len(p)) for q, p in zip(p_rows, prompts, strict=True)]
    torch.testing.assert_close(logits, plain.forward(plain.build_prefill(p_items, p_locs)))
    torch.testing.assert_close(
        r.mamba_pool.ssm_state[:, slots], plain.mamba_pool.ssm_state[:, p_slots]
    )
