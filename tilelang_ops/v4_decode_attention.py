"""DeepSeek-V4 decode attention: one query token per sequence, H query heads sharing one KV head (MQA).

Keys and values are the same vectors (V4 shares K and V in its compressed entries), drawn from
  - the sliding-window ring  ring [B, W, D], slot w valid iff w < ring_len[b] (the ring's order is
    irrelevant here: RoPE is already applied, and attention is a set operation);
  - the gathered compressed entries comp [B, K, D] with comp_valid [B, K] (kv_load's output).
A per-head sink logit sinks[H] joins the softmax denominator only (as in gpt-oss / DeepSeek-V4):
  out[b,h] = sum_n exp(s_n) v_n / (exp(sink_h) + sum_n exp(s_n)),  s_n = scale * q[b,h] . v_n
With no valid entry the output is exactly zero.
"""
import torch
import tilelang.language as T

from tilelang_ops.common import build, check, check_tensor, grid, item, target_of

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def v4_decode_attention_ref(q, ring, ring_len, comp, comp_valid, sinks, scale: float):
    """q [B, H, D], ring [B, W, D], ring_len [B], comp [B, K, D], comp_valid [B, K] bool, sinks [H] -> [B, H, D]."""
    _validate(q, ring, ring_len, comp, comp_valid, sinks)
    B, H, D = q.shape
    kv = torch.cat([ring, comp], 1).float()                                    # [B, N, D]
    W = ring.shape[1]
    valid = torch.cat([torch.arange(W, device=q.device) < ring_len.view(B, 1), comp_valid.bool()], 1)
    s = scale * torch.einsum("bhd,bnd->bhn", q.float(), kv)
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    s = torch.cat([s, sinks.float().view(1, H, 1).expand(B, H, 1)], -1)       # sink column, value 0
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("bhn,bnd->bhd", p, kv).to(q.dtype)


def make_v4_decode_attention(H: int, D: int, W: int, K: int, dtype: str, threads: int):
    """One work item = one (sequence, head): single-pass online softmax seeded with the sink (m = sink, l = 1)."""
    B = T.dynamic("B")

    @T.prim_func
    def attn(Q: T.Tensor((B, H, D), dtype), Ring: T.Tensor((B, W, D), dtype), RingLen: T.Tensor((B,), "int32"),
             Comp: T.Tensor((B, K, D), dtype), CompValid: T.Tensor((B, K), "uint8"), Sinks: T.Tensor((H,), "float32"),
             Scale: T.Tensor((1,), "float32"), Out: T.Tensor((B, H, D), dtype)):
        with T.Kernel(grid(B * H, threads), threads=threads) as bx:
            i = item(bx, threads)
            q = T.alloc_local((D,), "float32")
            acc = T.alloc_local((D,), "float32")
            st = T.alloc_local((4,), "float32")  # m, l, score, correction
            if i < B * H:
                b, h = i // H, i % H
                for d in T.serial(D):
                    q[d] = T.Cast("float32", Q[b, h, d])
                    acc[d] = 0.0
                st[0] = Sinks[h]
                st[1] = 1.0
                for n in T.serial(W + K):
                    ok = T.if_then_else(n < W, n < RingLen[b], CompValid[b, T.max(n - W, 0)] != 0)
                    if ok:
                        st[2] = 0.0
                        for d in T.serial(D):
                            st[2] += q[d] * T.Cast("float32", T.if_then_else(
                                n < W, Ring[b, T.min(n, W - 1), d], Comp[b, T.max(n - W, 0), d]))
                        st[2] = st[2] * Scale[0]
                        st[3] = T.exp(st[0] - T.max(st[0], st[2]))   # rescale of the old sum
                        st[0] = T.max(st[0], st[2])
                        st[2] = T.exp(st[2] - st[0])                 # weight of this entry
                        st[1] = st[1] * st[3] + st[2]
                        for d in T.serial(D):
                            acc[d] = acc[d] * st[3] + st[2] * T.Cast("float32", T.if_then_else(
                                n < W, Ring[b, T.min(n, W - 1), d], Comp[b, T.max(n - W, 0), d]))
                for d in T.serial(D):
                    Out[b, h, d] = T.Cast(dtype, acc[d] / st[1])
    return attn


def v4_decode_attention(q, ring, ring_len, comp, comp_valid, sinks, scale: float):
    """TileLang version of v4_decode_attention_ref (same arguments and result)."""
    _validate(q, ring, ring_len, comp, comp_valid, sinks)
    target = target_of(q, ring, ring_len, comp, comp_valid, sinks)
    check(q.dtype in DTYPES and ring.dtype == q.dtype and comp.dtype == q.dtype,
          f"v4_decode_attention kernel: q/ring/comp must share dtype float32 or bfloat16, got "
          f"{q.dtype}/{ring.dtype}/{comp.dtype}")
    check(target == "cuda" or q.dtype == torch.float32, "v4_decode_attention kernel: the C target runs fp32 only")
    B, H, D = q.shape
    out = torch.empty_like(q)
    if B == 0:
        return out
    sc = torch.tensor([float(scale)], dtype=torch.float32, device=q.device)
    k = build(make_v4_decode_attention, target, H, D, ring.shape[1], comp.shape[1], DTYPES[q.dtype])
    k(q.contiguous(), ring.contiguous(), ring_len.int().contiguous(), comp.contiguous(),
      comp_valid.to(torch.uint8).contiguous(), sinks.float().contiguous(), sc, out)
    return out


def _validate(q, ring, ring_len, comp, comp_valid, sinks):
    fl = (torch.float32, torch.bfloat16, torch.float16)
    check_tensor(q, "q", fl, 3)
    check_tensor(ring, "ring", fl, 3)
    check_tensor(comp, "comp", fl, 3)
    check_tensor(ring_len, "ring_len", (torch.int32, torch.int64), 1)
    check_tensor(comp_valid, "comp_valid", (torch.bool, torch.uint8, torch.int32, torch.int64), 2)
    check_tensor(sinks, "sinks", (torch.float32, torch.bfloat16), 1)
    B, H, D = q.shape
    check(ring.shape[0] == B and comp.shape[0] == B and ring_len.shape[0] == B and comp_valid.shape[0] == B,
          f"v4_decode_attention: batch sizes differ: q {B}, ring {ring.shape[0]}, ring_len {ring_len.shape[0]}, "
          f"comp {comp.shape[0]}, comp_valid {comp_valid.shape[0]}")
    check(ring.shape[2] == D and comp.shape[2] == D, f"v4_decode_attention: head dim {D} != ring/comp dims")
    check(comp_valid.shape[1] == comp.shape[1], "v4_decode_attention: comp_valid [B, K] must match comp [B, K, D]")
    check(sinks.shape[0] == H, f"v4_decode_attention: sinks has {sinks.shape[0]} entries for {H} heads")
