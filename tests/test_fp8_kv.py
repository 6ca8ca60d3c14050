"""FP8 E4M3 KV rows with one fp32 scale per row (deepinfer/formats/fp8.py): the documented rounding rule and
error bound, zero rows, refusals."""
import pytest
import torch

from deepinfer.formats.fp8 import E4M3_MAX, dequantize_fp8, fp8_bytes, quantize_fp8


def test_round_trip_within_the_bound_and_torch_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-4, 3, 64)[:, None]  # rows over 7 decades
    q, s = quantize_fp8(x)
    assert q.dtype == torch.uint8 and s.shape == (64, 1)
    deq = dequantize_fp8(q, s)
    assert bool(((x - deq).abs() <= x.abs() / 16 + s * 2 ** -10).all())
    # the row's largest magnitude maps to 448 exactly; every byte is torch's E4M3 rounding of x / s
    assert torch.equal(q.view(torch.float8_e4m3fn).float().abs().amax(1), torch.full((64,), E4M3_MAX))
    assert torch.equal(q, (x / s).to(torch.float8_e4m3fn).view(torch.uint8))


def test_zero_rows_and_output_dtype():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[1, 5] = -2.5
    q, s = quantize_fp8(x)
    assert s[0].item() == 0 and int(q[0].sum()) == 0
    out = dequantize_fp8(q, s, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, x)  # -2.5 is the row's amax: exact
    assert fp8_bytes(512) == 516


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_fp8(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scales \[\.\.\., 1\]"):
        dequantize_fp8(torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, 2))
