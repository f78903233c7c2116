"""The fused Kimi Delta Attention decode op (C++, kernels/csrc/kda_decode.cpp) against its torch
reference (kernels.gdn_step.gdn_decode with the per-channel gate and the sigmoid-gated norm):
the output and both pools after the step, for Kimi's unbounded gate and Ling-3's bounded one,
with padding rows (-1 and the reserved slot 0 repeated) and another conv width. This host's
level runs here; every level compiles in test_cpu_levels.py. Skips where the C++ kernels cannot
be built."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hybrid_serve.kernels import cpp_fused, gdn_step
from hybrid_serve.kernels.rmsnorm import rms_norm_gated_sigmoid
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)

reference = partial(gdn_step.gdn_decode, norm_gated=rms_norm_gated_sigmoid)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


def kda_case(B: int, H: int, d: int, Kc: int, scale: float = 1.0, layers: int = 2):
    """Inputs of one decode step: B live rows, then the padding rows (-1, slot 0 twice)."""
    inner, n_slots = H * d, B + 4
    slots = (torch.randperm(n_slots - 1)[:B] + 1).tolist()
    idx = torch.tensor(slots + [-1, 0, 0])
    T = len(idx)
    qkvz = torch.randn(T, 4 * inner) * scale
    ba = torch.randn(T, H + inner) * 2
    conv_pool = torch.randn(layers, n_slots, 3 * inner, Kc - 1)
    ssm_pool = torch.randn(layers, n_slots, H, d, d) * 0.3
    conv_w = torch.randn(3 * inner, Kc) * 0.3
    A_log = torch.empty(1, 1, H, 1).uniform_(1, 16).log_()  # Kimi's shape
    dt_bias = torch.randn(inner)
    dt_bias[0] = 30.0  # softplus past its linear threshold
    norm_w = torch.randn(d) * 0.1 + 1
    return slots, idx, qkvz, ba, conv_pool, ssm_pool, (conv_w, A_log, dt_bias, norm_w)


@pytest.mark.parametrize(
    ("B", "H", "d", "Kc", "scale", "bound"),
    [
        (1, 2, 16, 4, 1.0, None),  # Kimi's gate
        (5, 2, 32, 4, 1.0, -5.0),  # Ling-3's bounded gate
        (3, 3, 8, 3, 1.0, None),  # conv width 3, a head dim below the 8 lanes' tail
        (4, 2, 16, 4, 40.0, -5.0),  # conv outputs far into both tails of silu
        (9, 4, 128, 4, 1.0, None),  # Kimi-Linear's head dim
    ],
)
def test_kda_decode_matches_reference(B, H, d, Kc, scale, bound) -> None:
    torch.manual_seed(B * 10 + d)
    slots, idx, qkvz, ba, conv_pool, ssm_pool, weights = kda_case(B, H, d, Kc, scale)
    args = (1, *weights, idx, H, 1e-6)
    conv_ref, ssm_ref = conv_pool.clone(), ssm_pool.clone()
    y_ref = reference(qkvz, ba, conv_ref, ssm_ref, *args, gate_lower_bound=bound)
    y = cpp_fused.kda_decode(qkvz, ba, conv_pool, ssm_pool, *args, gate_lower_bound=bound)

    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    B_pad = [B, B + 2]  # -1 and the repeat of slot 0 (its first row runs, on the reserved slot)
    assert torch.equal(y[B_pad], torch.zeros_like(y[B_pad]))
    torch.testing.assert_close(ssm_pool, ssm_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv_pool, conv_ref)  # shifts and copies only
    untouched = [s for s in range(1, ssm_pool.shape[1]) if s not in slots]
    assert torch.equal(ssm_pool[1, untouched], ssm_ref[1, untouched])
    assert torch.equal(ssm_pool[0], ssm_ref[0])  # other layers untouched


def test_the_two_gate_forms_differ() -> None:
    """The bound selects the gate: the same inputs give other states with and without it."""
    torch.manual_seed(3)
    _, idx, qkvz, ba, conv_pool, ssm_pool, weights = kda_case(2, 2, 16, 4)
    args = (1, *weights, idx, 2, 1e-6)
    pools = [(conv_pool.clone(), ssm_pool.clone()) for _ in range(2)]
    y1 = cpp_fused.kda_decode(qkvz, ba, *pools[0], *args)
    y2 = cpp_fused.kda_decode(qkvz, ba, *pools[1], *args, gate_lower_bound=-5.0)
    assert not torch.allclose(y1, y2) and not torch.allclose(pools[0][1], pools[1][1])


def test_kda_verify_over_the_fused_decode_is_decode_steps() -> None:
    """The mixer's verify (`gdn_step.gdn_verify` over this op, row by row) leaves the states a
    plain decode of the same tokens leaves, and keeps the step slots' states."""
    torch.manual_seed(11)
    H, d, Kc, lens = 2, 16, 4, [3, 1, 2]
    N, T = len(lens), sum(lens)
    n_slots = 1 + N + T
    perm = (torch.randperm(n_slots - 1) + 1).tolist()
    slots, free = perm[:N], perm[N:]
    steps = [[free.pop() for _ in range(n - 1)] for n in lens]
    inner = H * d
    qkvz, ba = torch.randn(T, 4 * inner), torch.randn(T, H + inner)
    conv_pool = torch.randn(1, n_slots, 3 * inner, Kc - 1)
    ssm_pool = torch.randn(1, n_slots, H, d, d) * 0.3
    weights = (torch.randn(3 * inner, Kc) * 0.3, torch.randn(H) * 0.5, torch.randn(inner),
               torch.ones(d))  # fmt: skip
    decode = partial(cpp_fused.kda_decode, gate_lower_bound=-5.0)
    pools = (conv_pool.clone(), ssm_pool.clone())
    y = gdn_step.gdn_verify(qkvz, ba, *pools, 0, *weights, torch.tensor(slots), lens, steps, H,
                            1e-6, decode=decode)  # fmt: skip
    starts = [0, 3, 4]
    for n, slot in enumerate(slots):
        conv, ssm = conv_pool.clone(), ssm_pool.clone()
        for j in range(lens[n]):
            row = starts[n] + j
            want = decode(qkvz[row : row + 1], ba[row : row + 1], conv, ssm, 0, *weights,
                          torch.tensor([slot]), H, 1e-6)  # fmt: skip
            assert torch.equal(y[row : row + 1], want)
            if j < lens[n] - 1:
                assert torch.equal(pools[1][0, steps[n][j]], ssm[0, slot])
                assert torch.equal(pools[0][0, steps[n][j]], conv[0, slot])
        assert torch.equal(pools[1][0, slot], ssm[0, slot])
