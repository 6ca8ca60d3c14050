"""FP4 KV-cache formats: NVFP4 (main compressed KV) and MXFP4 (Lightning Indexer keys). Pure torch.

Both store E2M1 values, two per byte: element 2i in the low nibble, element 2i+1 in the high nibble.
A nibble is sign (bit 3) | magnitude code (bits 0-2) with magnitudes E2M1_GRID = 0, .5, 1, 1.5, 2, 3, 4, 6.
Negative values that round to magnitude 0 are stored as +0 (code 0), so every zero is the byte 0.

E2M1 rounding (both formats): round to nearest on the grid, ties to the even code (even mantissa bit):
    .25 -> 0, .75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; |v| > 6 saturates to 6.

NVFP4, blocks of 16 along the last dim, per-tensor fp32 `tensor_scale` ts (> 0, finite):
    s     = fp32(fp32(amax / 6) / ts)                     amax = max |x| over the block, in fp32
    s_hat = E4M3(min(s, 448))                             round to nearest even, subnormals kept
    v     = x / fp32(s_hat * ts)        (v = 0 when s_hat == 0)
    deq   = E2M1(v) * fp32(s_hat * ts)
  An all-zero block (or one whose scale underflows E4M3) stores scale byte 0 and dequantises to zeros.
  If s_hat < s (scale rounded down, or clamped at 448) then amax / (s_hat * ts) > 6 and those values
  saturate to +-6.

MXFP4 (OCP MX v1.0), blocks of 32, no tensor scale:
    e     = clamp(floor(log2(amax)) - 2, -127, 127)      (emax of E2M1 is 2); amax == 0 -> e = -127
    byte  = e + 127                                       (E8M0; 255 = NaN is never produced)
    v     = x * 2^-e  (exact),  deq = E2M1(v) * 2^e
  Values in [6, 8) * 2^e saturate to +-6 (the OCP rule clips the top of each block).

Non-finite input (NaN, +-Inf) raises ValueError: FP4 has no encoding for it and one bad value would
poison a whole block's scale. A last dim not a multiple of the block size raises ValueError.

Error bound (tests check it): with S = s_hat * ts (NVFP4) or 2^e (MXFP4), and the scale in E4M3's
normal range, |x - deq| <= max(S / 4, |x| / 4): half a grid step is <= 1/4 below 1 and <= |v| / 4 above,
and saturation overshoots by at most v - 6 <= v / 4 since v <= 6 * 16/15 (NVFP4) or v < 8 (MXFP4).
"""
import torch

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E4M3_MAX = 448.0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                          -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def nvfp4_bytes(D: int) -> int:
    """Bytes per D-vector in NVFP4: D/2 packed values + D/16 E4M3 scales (the fp32 tensor scale is per tensor)."""
    _check_dim(D, NVFP4_BLOCK, "nvfp4")
    return D // 2 + D // NVFP4_BLOCK


def mxfp4_bytes(D: int) -> int:
    """Bytes per D-vector in MXFP4: D/2 packed values + D/32 E8M0 scales."""
    _check_dim(D, MXFP4_BLOCK, "mxfp4")
    return D // 2 + D // MXFP4_BLOCK


def _check_dim(D: int, block: int, name: str):
    if D <= 0 or D % block:
        raise ValueError(f"{name}: last dim {D} must be a positive multiple of the block size {block}")


def _check_input(x: torch.Tensor, block: int, name: str):
    if not x.is_floating_point():
        raise ValueError(f"{name}: input must be floating point, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: input must have a last dim to block along")
    _check_dim(x.shape[-1], block, name)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: input contains non-finite values (NaN or Inf); FP4 cannot encode them")


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scale -> uint8 nibbles (RNE on the grid, saturating at 6).

    Each threshold is a midpoint; '>' sends the tie down, '>=' sends it up, always to the even code.
    """
    a = v.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = ((v < 0) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] uint8 nibbles -> [..., D/2] bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] fp32 grid values."""
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).flatten(-2).long()
    return E2M1_GRID.to(packed.device)[codes]


def _tensor_scale(tensor_scale) -> torch.Tensor:
    ts = float(tensor_scale)
    if not (ts > 0 and ts != float("inf")):
        raise ValueError(f"nvfp4: tensor_scale must be positive and finite, got {ts}")
    return torch.tensor(ts, dtype=torch.float32)


def quantize_nvfp4(x: torch.Tensor, tensor_scale=1.0):
    """x [..., D] float -> (packed uint8 [..., D/2], scales uint8 [..., D/16] E4M3 bit patterns)."""
    _check_input(x, NVFP4_BLOCK, "nvfp4")
    ts = _tensor_scale(tensor_scale).to(x.device)
    xb = x.float().unflatten(-1, (-1, NVFP4_BLOCK))
    amax = xb.abs().amax(-1)
    s = amax / torch.tensor(6.0, device=x.device) / ts
    s_hat = s.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (s_hat.float() * ts).unsqueeze(-1)
    v = torch.where(denom > 0, xb / torch.where(denom > 0, denom, 1.0), 0.0)  # zero scale: all-zero block
    return pack_nibbles(e2m1_encode(v.flatten(-2))), s_hat.view(torch.uint8)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, tensor_scale=1.0, dtype=torch.float32):
    """(packed [..., D/2], scales [..., D/16]) uint8 -> [..., D] in dtype."""
    ts = _tensor_scale(tensor_scale).to(packed.device)
    _check_packed(packed, scales, NVFP4_BLOCK, "nvfp4")
    vals = unpack_e2m1(packed).unflatten(-1, (-1, NVFP4_BLOCK))
    scale = scales.view(torch.float8_e4m3fn).float() * ts
    return (vals * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Block amax (fp32, >= 0) -> int32 shared exponent e = floor(log2(amax)) - 2 clamped to [-127, 127].

    frexp gives amax = m * 2^E with m in [0.5, 1) exactly, so floor(log2(amax)) = E - 1 with no log rounding.
    """
    _, E = torch.frexp(amax)
    e = (E.to(torch.int32) - 1 - 2).clamp(-127, 127)
    return torch.where(amax > 0, e, torch.full_like(e, -127))


def quantize_mxfp4(x: torch.Tensor):
    """x [..., D] float -> (packed uint8 [..., D/2], scales uint8 [..., D/32] E8M0 biased exponents)."""
    _check_input(x, MXFP4_BLOCK, "mxfp4")
    xb = x.float().unflatten(-1, (-1, MXFP4_BLOCK))
    e = mx_exponent(xb.abs().amax(-1))
    v = xb * torch.exp2(-e.float()).unsqueeze(-1)  # power of two: exact (2^127 and 2^-127 are fp32)
    return pack_nibbles(e2m1_encode(v.flatten(-2))), (e + 127).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32):
    """(packed [..., D/2], scales [..., D/32]) uint8 -> [..., D] in dtype."""
    _check_packed(packed, scales, MXFP4_BLOCK, "mxfp4")
    vals = unpack_e2m1(packed).unflatten(-1, (-1, MXFP4_BLOCK))
    scale = torch.exp2(scales.float() - 127.0)
    return (vals * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def _check_packed(packed: torch.Tensor, scales: torch.Tensor, block: int, name: str):
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    D = packed.shape[-1] * 2
    if packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * block != D:
        raise ValueError(f"{name}: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} disagree "
                         f"(need scales [..., D/{block}] for packed [..., D/2])")
