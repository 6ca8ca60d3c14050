"""KV load: gather the top-k compressed entries each decode query selected and dequantise them.

packed [num_blocks, block_entries, D/2] uint8 and scales [num_blocks, block_entries, D/G] uint8 (the
kv_store layout), block_table [B, max_blocks] int, indices [B, k] int entry positions in the sequence
(-1 = padding). Entry position p lives at block_table[b, p // block_entries], offset p % block_entries.
Returns (entries [B, k, D] in dtype, valid [B, k] bool); padded entries are exact zeros.
"""
import torch
import tilelang.language as T

from deepinfer.formats.fp4 import dequantize_mxfp4, dequantize_nvfp4
from tilelang_ops.args import GROUP, check, check_kv_load, entry_slots
from tilelang_ops.common import Tiles, build, target_of
from tilelang_ops.fp4_tl import e2m1_value, group_scale

TILE = 8192  # output elements per block: enough to amortise building the per-block byte table
OUT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def kv_load_ref(packed, scales, block_table, indices, fmt: str, tensor_scale=1.0, dtype=torch.float32):
    """Gather + dequantise with deepinfer.formats.fp4; see module docstring for shapes."""
    check_kv_load(packed, scales, block_table, indices, fmt)
    slot, valid = entry_slots(block_table, indices, packed.shape[1])
    p = packed.reshape(-1, packed.shape[-1])[slot]
    s = scales.reshape(-1, scales.shape[-1])[slot]
    out = dequantize_nvfp4(p, s, tensor_scale) if fmt == "nvfp4" else dequantize_mxfp4(p, s)
    return torch.where(valid.unsqueeze(-1), out, 0.0).to(dtype), valid


def pool_row(table, b, pos, BE: int):
    """Trace-time: the pool row of sequence b's entry position pos (clamped to row 0 for pos < 0 or a -1 block,
    so a select that evaluates both arms stays in bounds)."""
    p = T.max(pos, 0)
    return T.max(table[b, p // BE], 0) * BE + p % BE


def make_kv_load(fmt: str, D: int, BE: int, out_dtype: str, target: str):
    """A block dequantises E = TILE / D selected entries of one query b: grid (ceil(K / E), B).

    Each entry's pool row is looked up once; the packed rows are gathered into shared memory with
    vector loads, a byte table gives both values of a byte in one lookup, and the [E, D] tile (Out viewed
    as [B, K, D/2, 2], the two nibbles of a byte last) is stored with coalesced vector stores.
    Padding (and rows past K) gathers zero bytes, which decode to +0, the reference's padding value.
    """
    G = GROUP[fmt]
    NG, H, E = D // G, D // 2, max(TILE // D, 1)
    tl = Tiles(target)
    B, K, MB, S = T.dynamic("B"), T.dynamic("K"), T.dynamic("MB"), T.dynamic("S")

    @T.prim_func
    def kv_load(P: T.Tensor((S, H), "uint8"), Sc: T.Tensor((S, NG), "uint8"),
                Table: T.Tensor((B, MB), "int64"), Idx: T.Tensor((B, K), "int64"),
                TScale: T.Tensor((1,), "float32"), Out: T.Tensor((B, K, H, 2), out_dtype)):
        with tl.kernel(T.ceildiv(K, E), B) as (bx, b):
            slot = tl.shared((E,), "int64")      # pool row, -1 = padding or past K
            pk = tl.shared((E, H), "uint8")
            scale = tl.shared((E, NG), "float32")
            pair = tl.shared((256, 2), "float32")  # byte -> its two E2M1 values: one lookup per byte
            val = tl.fragment((E, H, 2), out_dtype)
            for e in tl.parallel(E):  # clamped indices: a select may evaluate both of its arms
                pos = T.if_then_else(bx * E + e < K, Idx[b, T.min(bx * E + e, K - 1)], -1)
                slot[e] = T.if_then_else(pos >= 0, pool_row(Table, b, pos, BE), -1)
            for e, h in tl.parallel(E, H):
                pk[e, h] = T.if_then_else(slot[e] >= 0, P[T.max(slot[e], 0), h], T.uint8(0))
            for e, g in tl.parallel(E, NG):
                byte = T.if_then_else(slot[e] >= 0, Sc[T.max(slot[e], 0), g], T.uint8(0))
                scale[e, g] = group_scale(byte, fmt, TScale[0])
            for i, t in tl.parallel(256, 2):
                pair[i, t] = e2m1_value(T.bitwise_and(T.shift_right(i, 4 * t), 15))
            for e, h, t in tl.parallel(E, H, 2):
                val[e, h, t] = T.Cast(out_dtype, pair[pk[e, h], t] * scale[e, h // (G // 2)])
            for e, h, t in tl.parallel(E, H, 2):  # apart from the decode so the stores vectorise
                if bx * E + e < K:
                    Out[b, bx * E + e, h, t] = val[e, h, t]
    return kv_load


def kv_load(packed, scales, block_table, indices, fmt: str, tensor_scale=1.0, dtype=torch.float32):
    """TileLang version of kv_load_ref (same arguments, same result)."""
    check_kv_load(packed, scales, block_table, indices, fmt)
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
      block_table.long().contiguous(), indices.long().contiguous(), ts, out.view(B, K, -1, 2))
    return out, indices >= 0
