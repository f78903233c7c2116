"""The Mamba2 reference ops against a naive per-token recurrence (float64): the chunked SSD scan
over packed sequences whose lengths the chunk does not divide, from pool states, with tracked
states at offsets off the chunk grid; the one-token update with padding rows; verify as
consecutive decode steps; the gate-first grouped norm against transformers' NemotronH norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels.mamba2_step import mamba2_decode, mamba2_verify
from hybrid_serve.kernels.rmsnorm import rms_norm_gate_first
from hybrid_serve.kernels.selective_state_update import selective_state_update
from hybrid_serve.kernels.ssd import mamba_chunk_scan_combined

H, P, N, G = 4, 3, 5, 2


def _inputs(T: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return dict(
        x=randn(T, H, P),
        dt=randn(T, H),
        A=-torch.rand(H, generator=gen) * 2 - 0.1,
        B=randn(T, G, N),
        C=randn(T, G, N),
        D=randn(H),
        dt_bias=randn(H) * 0.5,
    )


def _naive(inp: dict, lo: int, hi: int, state: torch.Tensor) -> tuple[torch.Tensor, list]:
    """float64 token loop over rows [lo, hi) from `state` [H, P, N]: (y, states after each)."""
    s = state.double().clone()
    ys, states = [], []
    per = H // G
    for t in range(lo, hi):
        dt = F.softplus(inp["dt"][t].double() + inp["dt_bias"].double())  # [H]
        y = torch.empty(H, P, dtype=torch.float64)
        for h in range(H):
            b, c = inp["B"][t, h // per].double(), inp["C"][t, h // per].double()
            x = inp["x"][t, h].double()
            s[h] = torch.exp(dt[h] * inp["A"][h].double()) * s[h] + dt[h] * torch.outer(x, b)
            y[h] = s[h] @ c + inp["D"][h].double() * x
        ys.append(y)
        states.append(s.clone())
    return torch.stack(ys), states


@pytest.mark.parametrize("chunk", [4, 16])
def test_chunk_scan_matches_token_loop_with_pool_states_and_tracking(chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [1, 7, 19, 37]  # none a multiple of either chunk size but the first
    T = sum(lens)
    inp = _inputs(T, gen)
    pool = torch.randn(9, H, P, N, generator=gen)
    start = pool.clone()
    slots = torch.tensor([3, 5, 1, 8])
    has_init = torch.tensor([True, False, True, True])
    track_offsets = [0, 6, 8, 37]  # 6 and 8 off the grid of chunk 16; 37 = the whole sequence
    track_slots = torch.tensor([0, 2, 4, 6])
    cu = torch.tensor([0, *lens]).cumsum(0)
    y = mamba_chunk_scan_combined(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, inp["D"], inp["dt_bias"],
        True, cu_seqlens=cu, ssm_states=pool, state_indices=slots, has_initial_state=has_init,
        track_offsets=track_offsets, track_indices=track_slots,
    )  # fmt: skip
    assert y.dtype == torch.float32 and y.shape == (T, H, P)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        init = start[slots[i]] if has_init[i] else torch.zeros(H, P, N)
        ref_y, ref_states = _naive(inp, lo, hi, init)
        torch.testing.assert_close(y[lo:hi].double(), ref_y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]].double(), ref_states[-1], rtol=1e-4, atol=1e-4)
        if track_offsets[i]:
            snap = pool[track_slots[i]].double()
            torch.testing.assert_close(snap, ref_states[track_offsets[i] - 1], rtol=1e-4, atol=1e-4)
    untouched = [0, 7]
    torch.testing.assert_close(pool[untouched], start[untouched], rtol=0, atol=0)


def test_tracking_changes_no_output() -> None:
    gen = torch.Generator().manual_seed(1)
    inp = _inputs(40, gen)
    cu = torch.tensor([0, 40])
    outs = []
    for offsets in (None, [24]):
        pool = torch.zeros(3, H, P, N)
        outs.append(
            mamba_chunk_scan_combined(
                inp["x"],
                inp["dt"],
                inp["A"],
                inp["B"],
                inp["C"],
                16,
                inp["D"],
                inp["dt_bias"],
                True,
                cu_seqlens=cu,
                ssm_states=pool,
                state_indices=torch.tensor([1]),
                has_initial_state=torch.tensor([False]),
                track_offsets=offsets,
                track_indices=torch.tensor([2]),
            )  # fmt: skip
        )
    assert torch.equal(outs[0], outs[1])


def test_state_update_matches_token_loop_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(2)
    inp = _inputs(5, gen)
    pool = torch.randn(6, H, P, N, generator=gen)
    start = pool.clone()
    slots = torch.tensor([4, 2, -1, 0, 0])  # rows 2 (pad id) and 4 (repeats slot 0) are padding
    y = selective_state_update(
        pool, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], True,
        state_batch_indices=slots,
    )  # fmt: skip
    for row, slot in enumerate(slots.tolist()):
        if row in (2, 4):
            assert not y[row].any()
            continue
        ref_y, ref_states = _naive(inp, row, row + 1, start[slot])
        torch.testing.assert_close(y[row].double(), ref_y[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot].double(), ref_states[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 3, 5]], start[[1, 3, 5]], rtol=0, atol=0)


def test_decode_steps_continue_a_chunked_prefill() -> None:
    """Prefill 21 tokens then 3 one-token updates == one 24-token scan."""
    gen = torch.Generator().manual_seed(3)
    inp = _inputs(24, gen)
    args = (inp["A"],)
    whole = torch.zeros(2, H, P, N)
    y = mamba_chunk_scan_combined(
        inp["x"], inp["dt"], *args, inp["B"], inp["C"], 8, inp["D"], inp["dt_bias"], True,
        cu_seqlens=torch.tensor([0, 24]), ssm_states=whole, state_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
    )  # fmt: skip
    split = torch.zeros(2, H, P, N)
    sub = {k: (v[:21] if v.shape[0] == 24 else v) for k, v in inp.items()}
    y_pre = mamba_chunk_scan_combined(
        sub["x"], sub["dt"], *args, sub["B"], sub["C"], 8, inp["D"], inp["dt_bias"], True,
        cu_seqlens=torch.tensor([0, 21]), ssm_states=split, state_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
    )  # fmt: skip
    ys = [y_pre]
    for t in range(21, 24):
        ys.append(
            selective_state_update(
                split,
                inp["x"][t : t + 1],
                inp["dt"][t : t + 1],
                inp["A"],
                inp["B"][t : t + 1],
                inp["C"][t : t + 1],
                inp["D"],
                inp["dt_bias"],
                True,
                state_batch_indices=torch.tensor([1]),
            )  # fmt: skip
        )
    torch.testing.assert_close(torch.cat(ys), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_gate_first_grouped_norm_matches_transformers() -> None:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    gen = torch.Generator().manual_seed(4)
    x, z = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
    for groups in (1, 4):
        ref = NemotronHRMSNormGated(32, group_size=32 // groups, eps=1e-5)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(32, generator=gen))
            expected = ref(x, z)
        got = rms_norm_gate_first(x, z, ref.weight.detach(), 1e-5, 32 // groups)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_verify_equals_consecutive_decode_steps() -> None:
    """Two requests of 3 and 2 rows verified at once == decoding them row by row, and the
    step slots hold the states after each row but the last."""
    gen = torch.Generator().manual_seed(5)
    inner, K = H * P, 4
    conv_dim = inner + 2 * G * N
    width = inner + conv_dim + H
    rows = torch.randn(5, width, generator=gen)
    conv_w, conv_b = torch.randn(conv_dim, K, generator=gen), torch.randn(conv_dim, generator=gen)
    A_log, dt_bias, D = torch.randn(H, generator=gen), torch.randn(H, generator=gen), torch.ones(H)
    norm_w = torch.randn(inner, generator=gen)
    conv0 = torch.randn(1, 8, conv_dim, K - 1, generator=gen)
    ssm0 = torch.randn(1, 8, H, P, N, generator=gen)
    params = (conv_w, conv_b, A_log, dt_bias, D, norm_w)

    conv, ssm = conv0.clone(), ssm0.clone()
    y = mamba2_verify(
        rows, conv, ssm, 0, *params, torch.tensor([1, 2]), [3, 2], [[3, 4], [5]], G, 1e-5
    )
    ref_conv, ref_ssm = conv0.clone(), ssm0.clone()
    for j, (row, slot) in enumerate([(0, 1), (1, 1), (2, 1), (3, 2), (4, 2)]):
        ref = mamba2_decode(
            rows[row : row + 1], ref_conv, ref_ssm, 0, *params, torch.tensor([slot]), G, 1e-5
        )
        torch.testing.assert_close(y[row : row + 1], ref, rtol=1e-6, atol=1e-6)
        step = {0: 3, 1: 4, 3: 5}.get(j)
        if step is not None:
            torch.testing.assert_close(ssm[0, step], ref_ssm[0, slot], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(conv[0, step], ref_conv[0, slot], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ssm[0, [1, 2]], ref_ssm[0, [1, 2]], rtol=1e-6, atol=1e-6)
