"""KV store: quantise new compressed-KV entries to NVFP4 (main KV) or MXFP4 (indexer keys) and scatter
them into the paged pool by slot mapping.

Paged layout: packed [num_blocks, block_entries, D/2] uint8, scales [num_blocks, block_entries, D/G] uint8
(G = 16 for nvfp4, 32 for mxfp4); slot = block * block_entries + offset; slot < 0 is padding (skipped).
Format and rounding are exactly deepinfer/formats/fp4.py's (the reference calls it; the kernel is bit-exact).
The kernel does not scan values: non-finite input is the caller's bug (the reference raises on it).
"""
import torch
import tilelang.language as T

from deepinfer.formats.fp4 import quantize_mxfp4, quantize_nvfp4
from tilelang_ops.args import GROUP, check, check_kv_store
from tilelang_ops.common import Tiles, build, target_of
from tilelang_ops.fp4_tl import absf, e2m1_code, e4m3_round, float_exponent, pow2

TILE = 2048  # elements per block: 16 per thread, two 16-byte loads of bf16
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def kv_store_ref(x, slot_mapping, packed, scales, fmt: str, tensor_scale=1.0):
    """x [N, D] float, slot_mapping [N] int -> writes packed / scales rows in place; returns None."""
    G = check_kv_store(x, slot_mapping, packed, scales, fmt)
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    q, s = quantize_nvfp4(x[keep], tensor_scale) if fmt == "nvfp4" else quantize_mxfp4(x[keep])
    slots = slot_mapping[keep].long()
    packed.view(-1, packed.shape[-1])[slots] = q
    scales.view(-1, scales.shape[-1])[slots] = s


def make_kv_store(fmt: str, D: int, dtype: str, target: str):
    """A block quantises a tile of R = TILE / G scale groups (X viewed as [N*NG, G], one group a row).

    The tile is read with coalesced vector loads, the group amax is a row reduction, codes go through
    shared memory so each packed byte can pair two neighbours; P / Sc are the pool viewed per group.
    """
    G = GROUP[fmt]
    NG, H, R = D // G, G // 2, TILE // G
    tl = Tiles(target)
    N, SG = T.dynamic("N"), T.dynamic("SG")  # tokens, pool group rows (num_blocks * block_entries * NG)

    @T.prim_func
    def kv_store(X: T.Tensor((N * NG, G), dtype), Slot: T.Tensor((N,), "int64"), TScale: T.Tensor((1,), "float32"),
                 P: T.Tensor((SG, H), "uint8"), Sc: T.Tensor((SG,), "uint8")):
        with tl.kernel(T.ceildiv(N * NG, R)) as bx:
            x = tl.fragment((R, G), "float32")
            mag = tl.fragment((R, G), "float32")
            amax = tl.fragment((R,), "float32")
            mult = tl.fragment((R,), "float32")
            dst = tl.shared((R,), "int64")       # pool group row, -1 = skip (padding or past N)
            code = tl.shared((R, G), "uint8")
            for r in tl.parallel(R):
                row = bx * R + r
                slot = T.if_then_else(row < N * NG, Slot[T.min(row, N * NG - 1) // NG], -1)
                dst[r] = T.if_then_else(slot >= 0, slot * NG + row % NG, -1)
            for r, j in tl.parallel(R, G):
                x[r, j] = T.if_then_else(bx * R + r < N * NG, T.Cast("float32", X[bx * R + r, j]), T.float32(0))
            for r, j in tl.parallel(R, G):
                mag[r, j] = absf(x[r, j])
            tl.reduce_max(mag, amax, 1)
            for r in tl.parallel(R):
                if fmt == "nvfp4":
                    s_hat, byte = e4m3_round(amax[r] / T.float32(6.0) / TScale[0])
                    mult[r] = s_hat * TScale[0]  # divisor; 0 only for all-zero groups
                else:
                    e = T.if_then_else(amax[r] > 0, T.max(float_exponent(amax[r]) - 2, -127), -127)
                    byte = e + 127
                    mult[r] = pow2(-e)          # multiplier 2^-e, exact
                if dst[r] >= 0:
                    Sc[dst[r]] = T.Cast("uint8", byte)
            for r, j in tl.parallel(R, G):  # scaled in place: e2m1_code repeats its operand many times
                if fmt == "nvfp4":
                    x[r, j] = T.if_then_else(mult[r] > 0, x[r, j] / mult[r], T.float32(0))
                else:
                    x[r, j] = x[r, j] * mult[r]
            for r, j in tl.parallel(R, G):
                code[r, j] = T.Cast("uint8", e2m1_code(x[r, j]))
            for r, j in tl.parallel(R, H):
                if dst[r] >= 0:
                    P[dst[r], j] = code[r, 2 * j] + T.shift_left(code[r, 2 * j + 1], 4)
    return kv_store


def kv_store(x, slot_mapping, packed, scales, fmt: str, tensor_scale=1.0):
    """TileLang version of kv_store_ref (same arguments, same bytes written)."""
    check_kv_store(x, slot_mapping, packed, scales, fmt)
    check(x.dtype in DTYPES, f"kv_store kernel: x dtype {x.dtype} unsupported (float32, bfloat16)")
    target = target_of(x, slot_mapping, packed, scales)
    check(target == "cuda" or x.dtype == torch.float32, "kv_store kernel: the C target runs fp32 only")
    check(packed.is_contiguous() and scales.is_contiguous(), "kv_store: packed and scales must be contiguous")
    if x.shape[0] == 0:
        return
    ts = torch.tensor([float(tensor_scale)], dtype=torch.float32)  # checked on the host: no device sync
    check(fmt == "mxfp4" or (0 < ts.item() < float("inf")), "kv_store: tensor_scale must be positive and finite")
    G = GROUP[fmt]
    k = build(make_kv_store, target, fmt, x.shape[1], DTYPES[x.dtype])
    k(x.contiguous().view(-1, G), slot_mapping.long().contiguous(), ts.to(x.device), packed.view(-1, G // 2),
      scales.view(-1))
