"""KV load: gather the top-k compressed entries each decode query selected and dequantise them.

packed [num_blocks, block_entries, D/2] uint8 and scales [num_blocks, block_entries, D/G] uint8 (the
kv_store layout), block_table [B, max_blocks] int, indices [B, k] int entry positions in the sequence
(-1 = padding). Entry position p lives at block_table[b, p // block_entries], offset p % block_entries.
Returns (entries [B, k, D] in dtype, valid [B, k] bool); padded entries are exact zeros.
"""
import torch
import tilelang.language as T

from deepinfer.formats.fp4 import dequantize_mxfp4, dequantize_nvfp4
from tilelang_ops.common import build, check, check_tensor, grid, item, target_of
from tilelang_ops.fp4_tl import e2m1_value, e4m3_decode, pow2_e8m0
from tilelang_ops.kv_store import GROUP

OUT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def kv_load_ref(packed, scales, block_table, indices, fmt: str, tensor_scale=1.0, dtype=torch.float32):
    """Gather + dequantise with deepinfer.formats.fp4; see module docstring for shapes."""
    _validate(packed, scales, block_table, indices, fmt)
    slot, valid = entry_slots(block_table, indices, packed.shape[1])
    p = packed.reshape(-1, packed.shape[-1])[slot]
    s = scales.reshape(-1, scales.shape[-1])[slot]
    out = dequantize_nvfp4(p, s, tensor_scale) if fmt == "nvfp4" else dequantize_mxfp4(p, s)
    return torch.where(valid.unsqueeze(-1), out, 0.0).to(dtype), valid


def entry_slots(block_table, indices, block_entries: int):
    """-> (flat pool rows [B, k] of the entries at `indices` (padding: row 0), valid [B, k])."""
    valid = indices >= 0
    pos = indices.long().clamp(min=0)
    return block_table.long().gather(1, pos // block_entries).clamp(min=0) * block_entries + pos % block_entries, valid


def make_kv_load(fmt: str, D: int, BE: int, out_dtype: str, threads: int):
    """One work item = one (query b, selected entry j, scale group g): G values."""
    G = GROUP[fmt]
    NG = D // G
    B, K, MB, S = T.dynamic("B"), T.dynamic("K"), T.dynamic("MB"), T.dynamic("S")

    @T.prim_func
    def kv_load(P: T.Tensor((S, D // 2), "uint8"), Sc: T.Tensor((S, NG), "uint8"),
                Table: T.Tensor((B, MB), "int64"), Idx: T.Tensor((B, K), "int64"),
                TScale: T.Tensor((1,), "float32"), Out: T.Tensor((B, K, D), out_dtype)):
        with T.Kernel(grid(B * K * NG, threads), threads=threads) as bx:
            i = item(bx, threads)
            scale = T.alloc_local((1,), "float32")
            if i < B * K * NG:
                b, j, g = i // (K * NG), (i // NG) % K, i % NG
                pos = Idx[b, j]
                if pos >= 0:
                    slot = Table[b, pos // BE] * BE + pos % BE
                    if fmt == "nvfp4":
                        scale[0] = e4m3_decode(Sc[slot, g]) * TScale[0]
                    else:
                        scale[0] = pow2_e8m0(Sc[slot, g])
                    for t in T.serial(G // 2):
                        byte = T.Cast("int32", P[slot, g * (G // 2) + t])
                        Out[b, j, g * G + 2 * t] = T.Cast(out_dtype, e2m1_value(T.bitwise_and(byte, 15)) * scale[0])
                        Out[b, j, g * G + 2 * t + 1] = T.Cast(out_dtype, e2m1_value(T.shift_right(byte, 4)) * scale[0])
                else:
                    for t in T.serial(G):
                        Out[b, j, g * G + t] = T.Cast(out_dtype, 0)
    return kv_load


def kv_load(packed, scales, block_table, indices, fmt: str, tensor_scale=1.0, dtype=torch.float32):
    """TileLang version of kv_load_ref (same arguments, same result)."""
    _validate(packed, scales, block_table, indices, fmt)
    check(dtype in OUT_DTYPES, f"kv_load kernel: output dtype {dtype} unsupported (float32, bfloat16)")
    target = target_of(packed, scales, block_table, indices)
    check(target == "cuda" or dtype == torch.float32, "kv_load kernel: the C target runs fp32 only")
    B, K = indices.shape
    out = torch.empty(B, K, packed.shape[-1] * 2, dtype=dtype, device=packed.device)
    if B * K == 0:
        return out, indices >= 0
    ts = torch.tensor([float(tensor_scale)], dtype=torch.float32, device=packed.device)
    k = build(make_kv_load, target, fmt, out.shape[-1], packed.shape[1], OUT_DTYPES[dtype])
    k(packed.contiguous().view(-1, packed.shape[-1]), scales.contiguous().view(-1, scales.shape[-1]),
      block_table.long().contiguous(), indices.long().contiguous(), ts, out)
    return out, indices >= 0


def _validate(packed, scales, block_table, indices, fmt):
    check(fmt in GROUP, f"kv_load: fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    check_tensor(packed, "packed", (torch.uint8,), 3)
    check_tensor(scales, "scales", (torch.uint8,), 3)
    check_tensor(block_table, "block_table", (torch.int32, torch.int64), 2)
    check_tensor(indices, "indices", (torch.int32, torch.int64), 2)
    D = packed.shape[-1] * 2
    check(scales.shape[:2] == packed.shape[:2] and scales.shape[-1] * GROUP[fmt] == D,
          f"kv_load: scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)} for {fmt}")
    check(block_table.shape[0] == indices.shape[0],
          f"kv_load: block_table batch {block_table.shape[0]} != indices batch {indices.shape[0]}")
