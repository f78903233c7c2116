"""The fused Mamba2 decode and verify ops (C++) against their torch reference (kernels.mamba2_step):
output and both pools after the step, fp32 within 1e-5, with padding rows (-1 and the reserved
slot 0 repeated), one group and several, N and P off the vector width, conv widths 4 and 3,
without conv bias or norm (Falcon-H1's `mamba_rms_norm=false`), and a dt limit that clamps.
Skips where the C++ kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels import cpp_fused, mamba2_step
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)

TOL = dict(rtol=1e-5, atol=1e-5)
CASES = [  # H, P, N, G, K, conv bias, norm, dt limit
    (16, 8, 16, 8, 4, True, True, (0.0, float("inf"))),  # the tiny NemotronH preset
    (4, 16, 128, 1, 4, True, True, (0.0, float("inf"))),  # one group, N = 128
    (4, 3, 5, 2, 3, True, True, (1e-3, 0.05)),  # odd P and N, conv width 3, a clamping limit
    (6, 8, 24, 3, 4, False, False, (0.0, float("inf"))),  # no conv bias, no norm
]


def layer(H, P, N, G, K, conv_bias, norm, slots: int, gen: torch.Generator) -> dict:
    inner = H * P
    conv_dim = inner + 2 * G * N

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    dt_bias = randn(H)
    dt_bias[0] = 25.0  # softplus past its linear threshold
    return dict(
        conv_pool=randn(2, slots, conv_dim, K - 1),
        ssm_pool=randn(2, slots, H, P, N) * 0.3,
        params=(
            randn(conv_dim, K) * 0.3,
            randn(conv_dim) if conv_bias else None,
            torch.empty(H).uniform_(1, 16, generator=gen).log_(),
            dt_bias,
            1 + randn(H) * 0.1,
            1 + randn(inner) * 0.1 if norm else None,
        ),
        width=inner + conv_dim + H,
    )


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize(("H", "P", "N", "G", "K", "conv_bias", "norm", "limit"), CASES)
def test_mamba2_decode_matches_reference(H, P, N, G, K, conv_bias, norm, limit) -> None:
    gen = torch.Generator().manual_seed(H * N + K)
    B, n_slots = 5, 9
    lay = layer(H, P, N, G, K, conv_bias, norm, n_slots, gen)
    slots = (torch.randperm(n_slots - 1, generator=gen)[:B] + 1).tolist()
    idx = torch.tensor(slots + [-1, 0, 0])  # padding: -1 and the reserved slot 0 twice
    zxbcdt = torch.randn(len(idx), lay["width"], generator=gen)
    conv_pool, ssm_pool = lay["conv_pool"], lay["ssm_pool"]
    args = (1, *lay["params"], idx, G, 1e-5, limit)

    conv_ref, ssm_ref = conv_pool.clone(), ssm_pool.clone()
    y_ref = mamba2_step.mamba2_decode(zxbcdt, conv_ref, ssm_ref, *args)
    y = cpp_fused.mamba2_decode(zxbcdt, conv_pool, ssm_pool, *args)

    torch.testing.assert_close(y, y_ref, **TOL)
    pads = [B, B + 2]  # -1 and the repeat of slot 0 (its first row runs, on the reserved slot)
    assert torch.equal(y[pads], torch.zeros_like(y[pads]))
    torch.testing.assert_close(ssm_pool, ssm_ref, **TOL)
    assert torch.equal(conv_pool, conv_ref)  # shifts only
    untouched = [s for s in range(1, n_slots) if s not in slots]
    assert torch.equal(ssm_pool[1, untouched], lay["ssm_pool"][1, untouched])


@pytest.mark.parametrize("lens", [[4], [1, 3, 2, 4]])
@pytest.mark.parametrize(("H", "P", "N", "G", "K", "conv_bias", "norm", "limit"), CASES[::2])
def test_mamba2_verify_is_decode_steps_keeping_each_state(
    lens, H, P, N, G, K, conv_bias, norm, limit
) -> None:
    """mamba2_verify (C++) equals the reference verify (decode steps row after row per
    request); the step slots hold the states after each row but the last, the running slot the
    last's."""
    gen = torch.Generator().manual_seed(sum(lens) + N)
    n, T = len(lens), sum(lens)
    n_slots = 1 + n + T
    lay = layer(H, P, N, G, K, conv_bias, norm, n_slots, gen)
    perm = (torch.randperm(n_slots - 1, generator=gen) + 1).tolist()
    slots, free = perm[:n], perm[n:]
    steps = [[free.pop() for _ in range(length - 1)] for length in lens]
    zxbcdt = torch.randn(T, lay["width"], generator=gen)
    outs = []
    for fn in (mamba2_step.mamba2_verify, cpp_fused.mamba2_verify):
        conv, ssm = lay["conv_pool"].clone(), lay["ssm_pool"].clone()
        y = fn(
            zxbcdt, conv, ssm, 1, *lay["params"], torch.tensor(slots), lens, steps, G, 1e-5,
            limit,
        )  # fmt: skip
        outs.append((y, conv, ssm))
    (y_ref, conv_ref, ssm_ref), (y, conv, ssm) = outs
    torch.testing.assert_close(y, y_ref, **TOL)
    assert torch.equal(conv, conv_ref)
    torch.testing.assert_close(ssm, ssm_ref, **TOL)
    kept = [s for row in steps for s in row]
    if kept:
        assert not torch.equal(ssm[1, kept], lay["ssm_pool"][1, kept])
    assert torch.equal(ssm[0], lay["ssm_pool"][0]) and torch.equal(conv[0], lay["conv_pool"][0])
