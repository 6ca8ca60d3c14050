"""FP8 KV-cache format: E4M3 values (float8_e4m3fn bit patterns) with one fp32 scale per row. Pure torch.

Per row x [D] (the last dim):
    s   = fp32(amax / 448)                  amax = max |x| over the row, in fp32; 448 is E4M3's largest
    q   = E4M3(x / s)                       round to nearest even, subnormals kept, saturating at 448
    deq = fp32(q) * s
  An all-zero row stores s = 0 and zero bytes, and dequantises to zeros.

A row is D + 4 bytes (bf16: 2D). One scale per row rather than per 16 values: E4M3 keeps 3 mantissa bits
at every magnitude from 2^-6 * s up, so a finer scale would buy range V4's RMS-normed K=V rows do not need.

Error bound (tests check it): |x - deq| <= |x| / 16 + s * 2^-10: half an ulp is 2^-4 of the value in
E4M3's normal range and half the subnormal step 2^-9 * s below it.

Non-finite input raises ValueError: the row's scale would be non-finite and poison every value in it.
"""
import torch

E4M3_MAX = 448.0
# byte -> its E4M3 value: torch.take on this table widens 15x faster than torch's float8 -> fp32 cast on the CPU
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def fp8_bytes(D: int) -> int:
    """Bytes per D-vector: D E4M3 values + one fp32 scale."""
    return D + 4


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (values uint8 [..., D] E4M3 bit patterns, scales fp32 [..., 1])."""
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"fp8: input must be a floating-point tensor with a last dim, got {x.dtype} {tuple(x.shape)}")
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("fp8: input contains non-finite values (NaN or Inf); a row's scale cannot cover them")
    scale = xf.abs().amax(-1, keepdim=True) / E4M3_MAX
    v = torch.where(scale > 0, xf / torch.where(scale > 0, scale, 1.0), 0.0)
    return v.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(values uint8 [..., D], scales fp32 [..., 1]) -> [..., D] in dtype."""
    if values.dtype != torch.uint8 or scales.shape != (*values.shape[:-1], 1):
        raise ValueError(f"fp8: values must be uint8 [..., D] and scales [..., 1], got {values.dtype} "
                         f"{tuple(values.shape)} and {tuple(scales.shape)}")
    return (torch.take(E4M3_VALUES.to(values.device), values.long()) * scales).to(dtype)
