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
from tilelang_ops.common import build, check, check_tensor, grid, item, target_of
from tilelang_ops.fp4_tl import absf, e2m1_code, e4m3_round, float_exponent, pow2

GROUP = {"nvfp4": 16, "mxfp4": 32}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def kv_store_ref(x, slot_mapping, packed, scales, fmt: str, tensor_scale=1.0):
    """x [N, D] float, slot_mapping [N] int -> writes packed / scales rows in place; returns None."""
    G = _validate(x, slot_mapping, packed, scales, fmt)
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    q, s = quantize_nvfp4(x[keep], tensor_scale) if fmt == "nvfp4" else quantize_mxfp4(x[keep])
    slots = slot_mapping[keep].long()
    packed.view(-1, packed.shape[-1])[slots] = q
    scales.view(-1, scales.shape[-1])[slots] = s


def make_kv_store(fmt: str, D: int, dtype: str, threads: int):
    """One work item = one (token, scale group): amax, scale, G/2 packed bytes, one scale byte."""
    G = GROUP[fmt]
    NG = D // G
    N, S = T.dynamic("N"), T.dynamic("S")  # tokens, total slots (num_blocks * block_entries)

    @T.prim_func
    def kv_store(X: T.Tensor((N, D), dtype), Slot: T.Tensor((N,), "int64"), TScale: T.Tensor((1,), "float32"),
                 P: T.Tensor((S, D // 2), "uint8"), Sc: T.Tensor((S, NG), "uint8")):
        with T.Kernel(grid(N * NG, threads), threads=threads) as bx:
            i = item(bx, threads)
            amax = T.alloc_local((1,), "float32")
            den = T.alloc_local((1,), "float32")
            if i < N * NG:
                n, g = i // NG, i % NG
                slot = Slot[n]
                if slot >= 0:
                    amax[0] = 0.0
                    for j in T.serial(G):
                        amax[0] = T.max(amax[0], absf(T.Cast("float32", X[n, g * G + j])))
                    if fmt == "nvfp4":
                        s_hat, byte = e4m3_round(amax[0] / T.float32(6.0) / TScale[0])
                        Sc[slot, g] = T.Cast("uint8", byte)
                        den[0] = s_hat * TScale[0]  # v = x / den; den == 0 only for all-zero blocks
                    else:
                        e = T.if_then_else(amax[0] > 0, T.max(float_exponent(amax[0]) - 2, -127), -127)
                        Sc[slot, g] = T.Cast("uint8", e + 127)
                        den[0] = pow2(-e)     # multiplier 2^-e, exact
                    for j in T.serial(G // 2):
                        x0 = T.Cast("float32", X[n, g * G + 2 * j])
                        x1 = T.Cast("float32", X[n, g * G + 2 * j + 1])
                        if fmt == "nvfp4":
                            v0 = T.if_then_else(den[0] > 0, x0 / den[0], T.float32(0))
                            v1 = T.if_then_else(den[0] > 0, x1 / den[0], T.float32(0))
                        else:
                            v0, v1 = x0 * den[0], x1 * den[0]
                        P[slot, g * (G // 2) + j] = T.Cast("uint8", e2m1_code(v0) + T.shift_left(e2m1_code(v1), 4))
    return kv_store


def kv_store(x, slot_mapping, packed, scales, fmt: str, tensor_scale=1.0):
    """TileLang version of kv_store_ref (same arguments, same bytes written)."""
    _validate(x, slot_mapping, packed, scales, fmt)
    check(x.dtype in DTYPES, f"kv_store kernel: x dtype {x.dtype} unsupported (float32, bfloat16)")
    target = target_of(x, slot_mapping, packed, scales)
    check(target == "cuda" or x.dtype == torch.float32, "kv_store kernel: the C target runs fp32 only")
    check(packed.is_contiguous() and scales.is_contiguous(), "kv_store: packed and scales must be contiguous")
    if x.shape[0] == 0:
        return
    ts = torch.tensor([float(tensor_scale)], dtype=torch.float32, device=x.device)
    check(fmt == "mxfp4" or (0 < ts.item() < float("inf")), "kv_store: tensor_scale must be positive and finite")
    k = build(make_kv_store, target, fmt, x.shape[1], DTYPES[x.dtype])
    k(x.contiguous(), slot_mapping.long().contiguous(), ts, packed.view(-1, packed.shape[-1]),
      scales.view(-1, scales.shape[-1]))


def _validate(x, slot_mapping, packed, scales, fmt):
    check(fmt in GROUP, f"kv_store: fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    G = GROUP[fmt]
    check_tensor(x, "x", (torch.float32, torch.bfloat16, torch.float16), 2)
    check_tensor(slot_mapping, "slot_mapping", (torch.int32, torch.int64), 1)
    check_tensor(packed, "packed", (torch.uint8,), 3)
    check_tensor(scales, "scales", (torch.uint8,), 3)
    N, D = x.shape
    check(D % G == 0, f"kv_store: D={D} must be a multiple of the {fmt} group {G}")
    check(slot_mapping.shape[0] == N, f"kv_store: slot_mapping has {slot_mapping.shape[0]} entries for {N} tokens")
    check(packed.shape[-1] == D // 2 and scales.shape[-1] == D // G and packed.shape[:2] == scales.shape[:2],
          f"kv_store: packed {tuple(packed.shape)} / scales {tuple(scales.shape)} do not fit D={D} {fmt}")
    return G
