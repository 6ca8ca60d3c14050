"""NVFP4 / MXFP4 formats of deepinfer/formats/fp4.py: hand-computed cases, brute-force rounding, error bounds."""
import math

import pytest
import torch

from deepinfer.formats.fp4 import (E2M1_GRID, dequantize_mxfp4, dequantize_nvfp4, e2m1_encode, mxfp4_bytes,
                                  nvfp4_bytes, quantize_mxfp4, quantize_nvfp4)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def slow_e2m1(v: float) -> int:
    """Nearest grid magnitude by exhaustive search; ties to the even code; sign only on nonzero codes."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(GRID[c] - a), c % 2))
    return best | (8 if v < 0 and best else 0)


def e4m3_values():
    """All finite non-negative E4M3 (fn) values by bit pattern, 0..0x7E."""
    out = []
    for b in range(0x7F):
        e, m = b >> 3, b & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


def test_e2m1_encode_matches_brute_force_including_ties():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = ties + [-t for t in ties] + (torch.rand(2000) * 16 - 8).tolist() + [-0.1, 6.0, 7.9, -100.0]
    got = e2m1_encode(torch.tensor(vals)).tolist()
    assert got == [slow_e2m1(v) for v in vals]
    # the tie rule spelled out
    assert e2m1_encode(torch.tensor(ties)).tolist() == [0, 2, 2, 4, 4, 6, 6]


def test_e4m3_scale_is_round_to_nearest_even():
    table = e4m3_values()
    s = torch.cat([torch.rand(3000) * 2.0 ** torch.randint(-12, 9, (3000,)).float(),
                   torch.tensor([(a + b) / 2 for a, b in zip(table, table[1:])])])  # every tie
    x = torch.zeros(len(s), 16)
    x[:, 3] = s * 6
    s_exact = x[:, 3] / 6  # the fp32 amax/6 quantize sees (equal to every tie: 5-bit mantissas times 3 are exact)
    _, scales = quantize_nvfp4(x)
    for sv, b in zip(s_exact.tolist(), scales.view(-1, 1).squeeze(1).tolist()):
        if sv >= 448:
            assert b == 0x7E
            continue
        best = min(range(0x7F), key=lambda i: (abs(table[i] - sv), i % 2))
        assert b == best, (sv, b, best)


def test_nvfp4_grid_values_roundtrip_exactly():
    row = torch.tensor(GRID + [-g for g in GRID])  # amax 6 -> scale exactly 1
    for ts in (1.0, 0.25):
        p, s = quantize_nvfp4(row * ts, ts)
        assert s.tolist() == [0x38]  # 1.0 in E4M3 = exponent 7, mantissa 0
        assert torch.equal(dequantize_nvfp4(p, s, ts), row * ts)


def test_nvfp4_ties_and_nibble_order():
    x = torch.tensor([0.25, 6.0, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0, 0, 0, 0, 0])
    p, s = quantize_nvfp4(x)
    assert s.tolist() == [0x38]
    # element 0 (0.25 -> code 0) low nibble, element 1 (6.0 -> code 7) high nibble
    assert p[0].item() == 0x70
    assert p[1].item() == 2 | (2 << 4)   # .75 -> 1.0, 1.25 -> 1.0
    assert p[2].item() == 4 | (4 << 4)   # 1.75 -> 2, 2.5 -> 2
    assert p[3].item() == 6 | (6 << 4)   # 3.5 -> 4, 5 -> 4
    assert p[4].item() == 0 | (0xA << 4)  # -0.25 -> +0, -0.75 -> -1
    assert dequantize_nvfp4(p, s).tolist() == [0, 6, 1, 1, 2, 2, 4, 4, 0, -1, -4, 0, 0, 0, 0, 0]


def test_all_zero_blocks():
    x = torch.zeros(2, 64)
    x[1, 40] = -0.0
    p, s = quantize_nvfp4(x)
    assert not p.any() and not s.any()
    assert torch.equal(dequantize_nvfp4(p, s), torch.zeros(2, 64))
    p, s = quantize_mxfp4(x)
    assert not p.any() and not s.any()  # smallest exponent, byte 0 = 2^-127
    assert torch.equal(dequantize_mxfp4(p, s), torch.zeros(2, 64))


def test_nvfp4_largest_and_smallest_scales():
    x = torch.zeros(4, 16)
    x[0, :2] = torch.tensor([6 * 448.0, -3 * 448.0])  # scale 448 = 0x7E exactly
    x[1, :2] = torch.tensor([1e6, 1.0])               # scale clamps at 448, 1e6 saturates to 6*448
    x[2, :2] = torch.tensor([6 * 2.0 ** -9, 2.0 ** -9])  # smallest subnormal scale 2^-9 = 0x01
    x[3, :1] = 6 * 2.0 ** -10                         # scale 2^-10 ties between 0 and 2^-9 -> 0
    p, s = quantize_nvfp4(x)
    assert s[:, 0].tolist() == [0x7E, 0x7E, 0x01, 0x00]
    d = dequantize_nvfp4(p, s)
    assert d[0, :2].tolist() == [6 * 448.0, -3 * 448.0]
    assert d[1, :2].tolist() == [6 * 448.0, 0.0]
    assert d[2, :2].tolist() == [6 * 2.0 ** -9, 2.0 ** -9]
    assert torch.equal(d[3], torch.zeros(16))


def test_nvfp4_scale_rounded_down_saturates():
    # amax/6 = 1.0625 ties between 1.0 and 1.125 -> 1.0 (even); 6.375 / 1.0 > 6 saturates to 6
    x = torch.tensor([6.375] + [0.0] * 15)
    p, s = quantize_nvfp4(x)
    assert s.tolist() == [0x38] and dequantize_nvfp4(p, s)[0].item() == 6.0


def test_mxfp4_scales():
    x = torch.zeros(5, 32)
    x[0, :3] = torch.tensor([6.0, 4.0, -0.5])          # floor(log2 6) = 2 -> e = 0, byte 127
    x[1, :2] = torch.tensor([7.9, 1.0])                # e = 0 too: 7.9 saturates to 6
    x[2, 0] = 1.5 * 2.0 ** 127                         # e = 125
    x[3, 0] = 2.0 ** -125                              # e = -127 (smallest), v = 4 exact
    x[4, 0] = 1e-40                                    # fp32 subnormal: e clamps to -127, v rounds to 0
    p, s = quantize_mxfp4(x)
    assert s[:, 0].tolist() == [127, 127, 252, 0, 0]
    d = dequantize_mxfp4(p, s)
    assert d[0, :3].tolist() == [6.0, 4.0, -0.5]
    assert d[1, :2].tolist() == [6.0, 1.0]
    assert d[2, 0].item() == 1.5 * 2.0 ** 127
    assert d[3, 0].item() == 2.0 ** -125
    assert d[4, 0].item() == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(2, 32)
    x[1, 7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize_nvfp4(x)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(x)


def test_bad_shapes_and_scales_raise():
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        quantize_nvfp4(torch.randn(3, 24))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mxfp4(torch.randn(3, 48))
    with pytest.raises(ValueError, match="tensor_scale"):
        quantize_nvfp4(torch.randn(3, 16), 0.0)
    with pytest.raises(ValueError, match="floating point"):
        quantize_nvfp4(torch.ones(16, dtype=torch.int32))
    p, s = quantize_nvfp4(torch.randn(2, 32))
    with pytest.raises(ValueError, match="disagree"):
        dequantize_nvfp4(p, s[:, :1])


@pytest.mark.parametrize("ts", [1.0, 0.37])
def test_nvfp4_random_error_bound(ts):
    """|x - deq| <= max(S/4, |x|/4), S = s_hat * ts; and s_hat within 1/16 of amax/(6 ts) (E4M3 normal range)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, 16, generator=g) * torch.exp2(torch.randint(-4, 5, (64, 8, 1), generator=g).float())
    x = x.flatten(1)
    p, s = quantize_nvfp4(x, ts)
    d = dequantize_nvfp4(p, s, ts)
    S = (s.view(torch.float8_e4m3fn).float() * ts).repeat_interleave(16, -1)
    assert ((x - d).abs() <= torch.maximum(S / 4, x.abs() / 4) * (1 + 1e-6)).all()
    target = x.unflatten(-1, (-1, 16)).abs().amax(-1) / 6 / ts
    assert ((s.view(torch.float8_e4m3fn).float() - target).abs() <= target / 16).all()
    assert (d.unflatten(-1, (-1, 16)).abs().amax(-1) <= 6 * S[:, ::16] * (1 + 1e-6)).all()


def test_mxfp4_random_error_bound():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, 32, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 4, 1), generator=g).float())
    x = x.flatten(1)
    p, s = quantize_mxfp4(x)
    d = dequantize_mxfp4(p, s)
    S = torch.exp2(s.float() - 127).repeat_interleave(32, -1)
    assert ((x - d).abs() <= torch.maximum(S / 4, x.abs() / 4)).all()
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1)
    assert (s.long() - 127 == torch.floor(torch.log2(amax.double())).long() - 2).all()


def test_dtypes_and_leading_dims():
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    p, s = quantize_nvfp4(x)
    assert p.shape == (2, 3, 32) and s.shape == (2, 3, 4) and p.dtype == torch.uint8
    assert dequantize_nvfp4(p, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    p, s = quantize_mxfp4(x)
    assert p.shape == (2, 3, 32) and s.shape == (2, 3, 2)
    assert torch.equal(dequantize_mxfp4(p, s), dequantize_mxfp4(p, s, torch.float64).float())


def test_byte_helpers():
    assert nvfp4_bytes(512) == 256 + 32 and mxfp4_bytes(128) == 64 + 4
    with pytest.raises(ValueError):
        nvfp4_bytes(40)
    assert E2M1_GRID.numel() == 16 and math.copysign(1, E2M1_GRID[8].item()) == -1
