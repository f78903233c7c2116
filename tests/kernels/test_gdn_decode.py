"""The fused Gated DeltaNet decode op (C++) against its torch reference (kernels.gdn_step):
output and both pools after the step, with padding rows (-1 and the reserved slot 0 repeated),
GQA ratios 1 and 2, and another conv width. Skips where the C++ kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels import cpp_fused, gdn_step
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize(
    ("B", "H", "HV", "dk", "dv", "Kc", "scale"),
    [
        (1, 2, 2, 16, 24, 4, 1.0),  # ratio 1
        (5, 2, 4, 32, 32, 4, 1.0),  # ratio 2 (the tiny preset)
        (3, 1, 3, 8, 40, 3, 1.0),  # ratio 3, conv width 3
        (4, 2, 4, 16, 16, 4, 40.0),  # conv outputs far into both tails of silu (its own exp)
        (9, 4, 8, 128, 128, 4, 1.0),  # the small preset's heads
    ],
)
def test_gdn_decode_matches_reference(B, H, HV, dk, dv, Kc, scale) -> None:
    torch.manual_seed(B * 10 + dk)
    key_dim, value_dim = H * dk, HV * dv
    conv_dim, layers, n_slots = 2 * key_dim + value_dim, 2, B + 4
    slots = (torch.randperm(n_slots - 1)[:B] + 1).tolist()
    idx = torch.tensor(slots + [-1, 0, 0])  # padding: -1 and the reserved slot 0 twice
    T = len(idx)
    qkvz = torch.randn(T, conv_dim + value_dim) * scale
    ba = torch.randn(T, 2 * HV) * 2
    conv_pool = torch.randn(layers, n_slots, conv_dim, Kc - 1)
    ssm_pool = torch.randn(layers, n_slots, HV, dk, dv) * 0.3
    conv_w = torch.randn(conv_dim, Kc) * 0.3
    A_log = torch.empty(HV).uniform_(1, 16).log_()
    dt_bias = torch.randn(HV)
    dt_bias[0] = 30.0  # softplus past its linear threshold
    norm_w = torch.randn(dv) * 0.1 + 1
    args = (1, conv_w, A_log, dt_bias, norm_w, idx, H, 1e-6)

    conv_ref, ssm_ref = conv_pool.clone(), ssm_pool.clone()
    y_ref = gdn_step.gdn_decode(qkvz, ba, conv_ref, ssm_ref, *args)
    y = cpp_fused.gdn_decode(qkvz, ba, conv_pool, ssm_pool, *args)

    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    pads = [B, B + 2]  # -1 and the repeat of slot 0 (its first row runs, on the reserved slot)
    assert torch.equal(y[pads], torch.zeros_like(y[pads]))
    torch.testing.assert_close(ssm_pool, ssm_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv_pool, conv_ref)  # shifts and copies only
    untouched = [s for s in range(1, n_slots) if s not in slots]
    assert torch.equal(ssm_pool[1, untouched], ssm_ref[1, untouched])


@pytest.mark.parametrize(("lens", "H", "HV", "dk", "dv", "Kc"), [
    ([4], 2, 4, 32, 32, 4),  # one request, three drafts
    ([1, 3, 2, 4], 2, 4, 16, 24, 4),  # ragged, one without drafts
    ([2, 2], 1, 3, 8, 40, 3),  # ratio 3, conv width 3
    ([4, 2], 2, 2, 128, 128, 4),  # the 2B's head shape: states aligned for streaming stores
])  # fmt: skip
def test_gdn_verify_is_decode_steps_keeping_each_state(lens, H, HV, dk, dv, Kc) -> None:
    """gdn_verify (C++ and reference) equals gdn_decode run row after row per request; the
    step slots hold the states after each row but the last, the running slot the last's."""
    torch.manual_seed(sum(lens) + dk)
    key_dim, value_dim = H * dk, HV * dv
    conv_dim, N, T = 2 * key_dim + value_dim, len(lens), sum(lens)
    n_slots = 1 + N + T
    perm = (torch.randperm(n_slots - 1) + 1).tolist()
    slots, free = perm[:N], perm[N:]
    steps = [[free.pop() for _ in range(n - 1)] for n in lens]
    qkvz = torch.randn(T, conv_dim + value_dim)
    ba = torch.randn(T, 2 * HV) * 2
    conv_pool = torch.randn(2, n_slots, conv_dim, Kc - 1)
    ssm_pool = torch.randn(2, n_slots, HV, dk, dv) * 0.3
    conv_w = torch.randn(conv_dim, Kc) * 0.3
    A_log = torch.empty(HV).uniform_(1, 16).log_()
    dt_bias, norm_w = torch.randn(HV), torch.randn(dv) * 0.1 + 1
    params = (1, conv_w, A_log, dt_bias, norm_w)

    # expected: each request's rows through gdn_decode one at a time, states recorded
    conv_e, ssm_e = conv_pool.clone(), ssm_pool.clone()
    y_e, kept_e, start = torch.empty(T, value_dim), {}, 0
    for n, length in enumerate(lens):
        for j in range(length):
            r = start + j
            idx = torch.tensor([slots[n]])
            y_e[r] = gdn_step.gdn_decode(qkvz[r : r + 1], ba[r : r + 1], conv_e, ssm_e, *params,
                                         idx, H, 1e-6)[0]  # fmt: skip
            if j < length - 1:
                kept_e[steps[n][j]] = (conv_e[1, slots[n]].clone(), ssm_e[1, slots[n]].clone())
        start += length
    for fn in (gdn_step.gdn_verify, cpp_fused.gdn_verify):
        conv, ssm = conv_pool.clone(), ssm_pool.clone()
        y = fn(qkvz, ba, conv, ssm, *params, torch.tensor(slots), lens, steps, H, 1e-6)
        torch.testing.assert_close(y, y_e, rtol=1e-4, atol=1e-5)
        for slot, (c, s) in kept_e.items():
            assert torch.equal(conv[1, slot], c)
            torch.testing.assert_close(ssm[1, slot], s, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ssm[1, slots], ssm_e[1, slots], rtol=1e-4, atol=1e-5)
        assert torch.equal(conv[1, slots], conv_e[1, slots])
        assert torch.equal(ssm[0], ssm_pool[0]) and torch.equal(conv[0], conv_pool[0])

    # the C++ verify against the C++ decode, bit for bit: its outputs, the kept states (streamed
    # to their slots) and the running ones are those of one decode step per row
    conv_e, ssm_e = conv_pool.clone(), ssm_pool.clone()
    y_e, kept_e, start = torch.empty(T, value_dim), {}, 0
    for n, length in enumerate(lens):
        for j in range(length):
            r, idx = start + j, torch.tensor([slots[n]])
            y_e[r] = cpp_fused.gdn_decode(qkvz[r : r + 1], ba[r : r + 1], conv_e, ssm_e, *params,
                                          idx, H, 1e-6)[0]  # fmt: skip
            if j < length - 1:
                kept_e[steps[n][j]] = (conv_e[1, slots[n]].clone(), ssm_e[1, slots[n]].clone())
        start += length
    conv, ssm = conv_pool.clone(), ssm_pool.clone()
    y = cpp_fused.gdn_verify(qkvz, ba, conv, ssm, *params, torch.tensor(slots), lens, steps, H,
                             1e-6)  # fmt: skip
    assert torch.equal(y, y_e)
    for slot, (c, s) in kept_e.items():
        conv_e[1, slot], ssm_e[1, slot] = c, s
    assert torch.equal(conv, conv_e) and torch.equal(ssm, ssm_e)  # every other slot untouched
