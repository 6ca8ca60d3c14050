"""DeepSeek-V4 decode attention: one query token per sequence, H query heads sharing one KV head (MQA).

Keys and values are the same vectors (V4 shares K and V in its compressed entries), drawn from
  - the sliding-window ring  ring [B, W, D], slot w valid iff w < ring_len[b] (the ring's order is
    irrelevant here: RoPE is already applied, and attention is a set operation);
  - the gathered compressed entries comp [B, K, D] with comp_valid [B, K] (kv_load's output), or in
    v4_decode_attention_fp4 the entries themselves in the paged FP4 pool (kv_load's arguments).
A per-head sink logit sinks[H] joins the softmax denominator only (as in gpt-oss / DeepSeek-V4):
  out[b,h] = sum_n exp(s_n) v_n / (exp(sink_h) + sum_n exp(s_n)),  s_n = scale * q[b,h] . v_n
With no valid entry the output is exactly zero.
"""
import torch
import tilelang.language as T

from tilelang_ops.args import GROUP, check, check_kv_load, check_v4_decode_attention
from tilelang_ops.common import Tiles, build, target_of
from tilelang_ops.fp4_tl import e2m1_value, group_scale
from tilelang_ops.kv_load import kv_load_ref, pool_row

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def v4_decode_attention_ref(q, ring, ring_len, comp, comp_valid, sinks, scale: float):
    """q [B, H, D], ring [B, W, D], ring_len [B], comp [B, K, D], comp_valid [B, K] bool, sinks [H] -> [B, H, D]."""
    check_v4_decode_attention(q, ring, ring_len, comp, comp_valid, sinks)
    B, H, D = q.shape
    kv = torch.cat([ring, comp], 1).float()                                    # [B, N, D]
    W = ring.shape[1]
    valid = torch.cat([torch.arange(W, device=q.device) < ring_len.view(B, 1), comp_valid.bool()], 1)
    s = scale * torch.einsum("bhd,bnd->bhn", q.float(), kv)
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    s = torch.cat([s, sinks.float().view(1, H, 1).expand(B, H, 1)], -1)       # sink column, value 0
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("bhn,bnd->bhd", p, kv).to(q.dtype)


LOG2E = 1.4426950408889634
BLOCK_N = 64        # entries per tile
BLOCK_H = 64        # query heads per block: all heads share the keys, so a block reads each tile once
THREADS = 256       # two warpgroups on the [64, 512] output accumulator, as FlashMLA-style decode kernels
SPLIT_WAVES = 2     # split-K until the grid fills about this many waves of the GPU's SMs


def make_v4_decode_attention(H: int, D: int, W: int, K: int, dtype: str, splits: int = 1, fmt: str = "dense",
                             BE: int = 0, *, target: str):
    """Split-K flash decoding: grid (B, H / BLOCK_H, splits); split s of sequence b takes the tiles
    s, s + splits, ... of its W + K entries (ring rows, then compressed entries). Per tile: scores
    [BLOCK_H, BLOCK_N] = Q K^T on tensor cores, masked, online softmax in base 2, O += P V (V = K).
    Each split writes its normalised partial output and log2-sum-exp; the combine kernel adds the sink.

    fmt 'dense': Comp [B, K, D] in dtype with CompValid [B, K]. fmt 'nvfp4' / 'mxfp4': the compressed
    entries stay in the paged FP4 pool (kv_load's layout: packed [S, D/2], scales [S, D/G], block table,
    entry positions [B, K], -1 = padding) and are dequantised in the tile, so they never round-trip
    through global memory as bf16.
    """
    tl = Tiles(target, THREADS)
    BH, BN = min(BLOCK_H, H), BLOCK_N
    NG = D // GROUP[fmt] if fmt in GROUP else 1
    tiles = (W + K + BN - 1) // BN
    B = T.dynamic("B")
    S, MB = T.dynamic("S"), T.dynamic("MB")   # FP4 pool rows, block-table width
    if fmt == "dense":
        comp_types = (T.Tensor((B, K, D), dtype), T.Tensor((B, K), "uint8"), T.Tensor((1, 1), "int64"),
                      T.Tensor((1, 1), "int64"))
    else:
        comp_types = (T.Tensor((S, D // 2), "uint8"), T.Tensor((S, NG), "uint8"), T.Tensor((B, MB), "int64"),
                      T.Tensor((B, K), "int64"))

    @T.prim_func
    def attn(Q: T.Tensor((B, H, D), dtype), Ring: T.Tensor((B, W, D), dtype), RingLen: T.Tensor((B,), "int32"),
             Comp: comp_types[0], CompAux: comp_types[1], CompTable: comp_types[2], CompIdx: comp_types[3],
             Scale: T.Tensor((2,), "float32"), OPart: T.Tensor((B, H, splits, D), "float32"),
             LsePart: T.Tensor((B, H, splits), "float32")):
        with tl.kernel(B, H // BH, splits) as (b, hb, s):
            q = tl.shared((BH, D), dtype)
            kv = tl.shared((BN, D), dtype)
            p_s = tl.shared((BH, BN), dtype)
            row_ok = tl.shared((BN,), "int32")         # entry n0 + i is a valid key
            slot = tl.shared((BN,), "int32")           # FP4: its pool row
            scales = tl.shared((BN, NG), "float32")    # FP4: its groups' decoded scales
            e2m1 = tl.shared((16,), "float32")         # FP4: nibble -> value
            acc_s = tl.fragment((BH, BN), "float32")
            acc_o = tl.fragment((BH, D), "float32")
            m = tl.fragment((BH,), "float32")
            m_prev = tl.fragment((BH,), "float32")
            alpha = tl.fragment((BH,), "float32")
            l_sum = tl.fragment((BH,), "float32")
            l_tile = tl.fragment((BH,), "float32")
            T.copy(Q[b, hb * BH:(hb + 1) * BH, :], q)
            T.fill(acc_o, 0)
            T.fill(l_sum, 0)
            T.fill(m, -T.infinity("float32"))
            if fmt != "dense":
                for c in tl.parallel(16):
                    e2m1[c] = e2m1_value(c)
            for it in T.serial(T.ceildiv(tiles - s, splits)):
                n0 = (s + it * splits) * BN
                # Which rows are keys, then the tile: ring rows, then compressed entries (zeros past the end)
                for i in tl.parallel(BN):
                    row_ok[i] = T.Cast("int32", T.if_then_else(
                        n0 + i < W, n0 + i < RingLen[b], T.And(n0 + i < W + K, (
                            CompAux[b, T.min(T.max(n0 + i - W, 0), K - 1)] != 0 if fmt == "dense" else
                            CompIdx[b, T.min(T.max(n0 + i - W, 0), K - 1)] >= 0))))
                if fmt == "dense":
                    for i, d in tl.parallel(BN, D):
                        kv[i, d] = T.if_then_else(n0 + i < W, Ring[b, T.min(n0 + i, W - 1), d], T.if_then_else(
                            n0 + i < W + K, Comp[b, T.min(T.max(n0 + i - W, 0), K - 1), d], T.Cast(dtype, 0)))
                else:  # two loops, each for the tiles that need it, so the ring rows keep their vector loads
                    if n0 < W:
                        for i, d in tl.parallel(BN, D):
                            kv[i, d] = T.if_then_else(n0 + i < W, Ring[b, T.min(n0 + i, W - 1), d], T.Cast(dtype, 0))
                    if n0 + BN > W:
                        for i in tl.parallel(BN):
                            pos = CompIdx[b, T.min(T.max(n0 + i - W, 0), K - 1)]
                            slot[i] = T.Cast("int32", pool_row(CompTable, b, pos, BE))
                        for i, g in tl.parallel(BN, NG):  # a padding row's scale is 0: its zeros are never keys
                            scales[i, g] = T.if_then_else(T.And(n0 + i >= W, row_ok[i] != 0),
                                                          group_scale(CompAux[slot[i], g], fmt, Scale[1]), 0.0)
                        for i, d in tl.parallel(BN, D):
                            if n0 + i >= W:
                                kv[i, d] = T.Cast(dtype, scales[i, d // (D // NG)] * e2m1[T.bitwise_and(
                                    T.shift_right(T.Cast("int32", Comp[slot[i], d // 2]), 4 * (d % 2)), 15)])
                T.clear(acc_s)
                T.gemm(q, kv, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for h, i in tl.parallel(BH, BN):
                    acc_s[h, i] = T.if_then_else(row_ok[i] != 0, acc_s[h, i] * Scale[0], -T.infinity("float32"))
                T.copy(m, m_prev)
                tl.reduce_max(acc_s, m, dim=1, clear=False)
                for h in tl.parallel(BH):
                    alpha[h] = T.if_then_else(m[h] > -T.infinity("float32"), T.exp2(m_prev[h] - m[h]), 1.0)
                for h, i in tl.parallel(BH, BN):   # an all-masked row has m = -inf: its weights are exp2(-inf) = 0
                    acc_s[h, i] = T.exp2(acc_s[h, i] - T.if_then_else(m[h] > -T.infinity("float32"), m[h], 0.0))
                tl.reduce_sum(acc_s, l_tile, dim=1)
                for h in tl.parallel(BH):
                    l_sum[h] = l_sum[h] * alpha[h] + l_tile[h]
                for h, d in tl.parallel(BH, D):
                    acc_o[h, d] *= alpha[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv, acc_o, policy=T.GemmWarpPolicy.FullCol)
            for h, d in tl.parallel(BH, D):
                acc_o[h, d] = T.if_then_else(l_sum[h] > 0, acc_o[h, d] / l_sum[h], 0.0)
            T.copy(acc_o, OPart[b, hb * BH:(hb + 1) * BH, s, :])
            for h in tl.parallel(BH):
                LsePart[b, hb * BH + h, s] = T.if_then_else(l_sum[h] > 0, T.log2(l_sum[h]) + m[h],
                                                             -T.infinity("float32"))
    return attn


def make_combine(H: int, D: int, splits: int, dtype: str, *, target: str):
    """Out[b, h] = sum_s w_s OPart[b, h, s], w_s = 2^(lse_s - M) / (2^(sink_h - M) + sum_s' 2^(lse_s' - M)) with
    M the largest of the lse and the sink (base 2): the splits' softmaxes merged, the sink in the denominator
    only. One block per (sequence, head), its threads over D."""
    tl = Tiles(target, 128)
    B = T.dynamic("B")

    @T.prim_func
    def combine(OPart: T.Tensor((B, H, splits, D), "float32"), LsePart: T.Tensor((B, H, splits), "float32"),
                Sinks: T.Tensor((H,), "float32"), Out: T.Tensor((B, H, D), dtype)):
        with tl.kernel(B, H) as (b, h):
            lse = tl.fragment((splits,), "float32")
            m = tl.fragment((1,), "float32")
            w = tl.fragment((splits,), "float32")
            den = tl.fragment((1,), "float32")
            o = tl.fragment((D,), "float32")
            T.copy(LsePart[b, h, :], lse)
            tl.reduce_max(lse, m, dim=0)
            m[0] = T.max(m[0], Sinks[h] * LOG2E)
            for i in tl.parallel(splits):
                w[i] = T.exp2(lse[i] - m[0])
            tl.reduce_sum(w, den, dim=0)
            den[0] = den[0] + T.exp2(Sinks[h] * LOG2E - m[0])
            T.fill(o, 0)
            for i in T.serial(splits):
                for d in tl.parallel(D):
                    o[d] += OPart[b, h, i, d] * (w[i] / den[0])
            T.copy(o, Out[b, h, :])
    return combine


def num_splits(B: int, H: int, N: int, target: str) -> int:
    """Enough splits to fill SPLIT_WAVES waves of the SMs (one on the C target), at most one per tile."""
    if target != "cuda" or N == 0:
        return 1
    blocks = B * max(H // BLOCK_H, 1)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return max(1, min(-(-SPLIT_WAVES * sms // blocks), -(-N // BLOCK_N)))


def v4_decode_attention(q, ring, ring_len, comp, comp_valid, sinks, scale: float, splits: int | None = None):
    """TileLang version of v4_decode_attention_ref (same arguments and result); splits: split-K count
    (None: by batch size and SM count)."""
    check_v4_decode_attention(q, ring, ring_len, comp, comp_valid, sinks)
    target = _check_kernel_inputs(q, ring, comp, ring_len, comp_valid, sinks)
    if comp.shape[1] == 0:  # a kernel tensor needs a column: one invalid entry, which attends to nothing
        comp, comp_valid = q.new_zeros(q.shape[0], 1, q.shape[2]), comp_valid.new_zeros(q.shape[0], 1)
    none = torch.zeros(1, 1, dtype=torch.int64, device=q.device)
    return _run(q, ring, ring_len, sinks, scale, splits, target, "dense", comp.shape[1], 0,
                (comp.contiguous(), comp_valid.to(torch.uint8).contiguous(), none, none), 1.0)


def v4_decode_attention_fp4_ref(q, ring, ring_len, packed, scales, block_table, indices, sinks, scale: float,
                                fmt: str, tensor_scale=1.0):
    """The compressed entries taken from the paged FP4 pool: kv_load_ref then v4_decode_attention_ref.
    packed / scales / block_table / indices as kv_load's (indices [B, K], -1 = padding)."""
    comp, valid = kv_load_ref(packed, scales, block_table, indices, fmt, tensor_scale, q.dtype)
    return v4_decode_attention_ref(q, ring, ring_len, comp, valid, sinks, scale)


def v4_decode_attention_fp4(q, ring, ring_len, packed, scales, block_table, indices, sinks, scale: float,
                            fmt: str, tensor_scale=1.0, splits: int | None = None):
    """TileLang version of v4_decode_attention_fp4_ref: entries dequantised in the attention tile."""
    comp_like = q.new_empty(1, 1, 1).expand(indices.shape[0], indices.shape[1], packed.shape[-1] * 2)
    check_v4_decode_attention(q, ring, ring_len, comp_like, indices, sinks)
    check_kv_load(packed, scales, block_table, indices, fmt)
    target = _check_kernel_inputs(q, ring, ring_len, packed, scales, block_table, indices, sinks)
    if indices.shape[1] == 0:  # as in v4_decode_attention: one padding entry
        indices = indices.new_full((indices.shape[0], 1), -1)
    return _run(q, ring, ring_len, sinks, scale, splits, target, fmt, indices.shape[1], packed.shape[1],
                (packed.contiguous().view(-1, packed.shape[-1]), scales.contiguous().view(-1, scales.shape[-1]),
                 block_table.long().contiguous(), indices.long().contiguous()), tensor_scale)


def _check_kernel_inputs(q, ring, *rest):
    target = target_of(q, ring, *rest)
    check(q.dtype in DTYPES and ring.dtype == q.dtype and all(t.dtype == q.dtype for t in rest
                                                              if t.is_floating_point() and t.dim() == 3),
          f"v4_decode_attention kernel: q/ring/comp must share dtype float32 or bfloat16, got "
          f"{q.dtype}/{ring.dtype}/{[t.dtype for t in rest if t.dim() == 3]}")
    check(target == "cuda" or q.dtype == torch.float32, "v4_decode_attention kernel: the C target runs fp32 only")
    H = q.shape[1]
    check(target != "cuda" or (H % min(BLOCK_H, H) == 0 and min(BLOCK_H, H) % 16 == 0),
          f"v4_decode_attention kernel: {H} heads; on CUDA a multiple of 64, or 16, 32 or 48")
    return target


def _run(q, ring, ring_len, sinks, scale, splits, target, fmt, K, BE, comp, tensor_scale):
    """Launch the split kernel then the combine kernel; comp: the four compressed-entry arguments."""
    B, H, D = q.shape
    W = ring.shape[1]
    out = torch.empty_like(q)
    if B == 0:
        return out
    splits = splits or num_splits(B, H, W + K, target)
    o_part = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    sc = torch.tensor([float(scale) * LOG2E, float(tensor_scale)], dtype=torch.float32, device=q.device)
    dt = DTYPES[q.dtype]
    build(make_v4_decode_attention, target, H, D, W, K, dt, splits, fmt, BE)(
        q.contiguous(), ring.contiguous(), ring_len.int().contiguous(), *comp, sc, o_part, lse_part)
    build(make_combine, target, H, D, splits, dt)(o_part, lse_part, sinks.float().contiguous(), out)
    return out
