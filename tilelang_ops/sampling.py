"""Sampling: logits [B, V] fp32 -> token ids [B] int64, per-row temperature / top_k / top_p / min_p and a
seeded Gumbel-max draw that is reproducible across the torch reference and the kernel.

Per row (z = logits / temperature in fp32):
  temperature <= 0  -> greedy: first index of the max logit.
  min_p > 0         -> keep exp(z - max z) >= min_p.
  0 < top_k < V     -> of those, keep key(z) >= t_k, t_k the largest key with count(kept, key >= t_k) >= top_k
                       (the top_k-th largest value; ties with it are kept).
  top_p < 1         -> of those, keep key(z) >= t_p, t_p the largest key whose kept mass
                       sum exp(z - max z) reaches top_p * (total kept mass) (ties kept).
  token = first argmax over kept tokens of z + g, g = -log(-log(u)), u = uniform(seed, offset, token).
key() is the order-preserving int of the fp32 bits; thresholds are found by 32-step bit bisection, the
same in both versions. A row with no logit above -inf returns -1. Logits must not be NaN or +inf.

Uniforms: a counter-based hash (lowbias32, 32-bit multiply-xorshift) of (seed lo, seed hi, offset, token):
  row = mix(mix(mix(seed_lo) ^ seed_hi) ^ offset);  h = mix(row ^ mix(token));  u = ((h >> 9) + .5) * 2^-23
so u is in (0, 1), exact in fp32, and bit-identical on every target.
"""
import torch
import tilelang.language as T

from tilelang_ops.common import build, check, check_tensor, grid, item, target_of

M32 = 0xFFFFFFFF


def mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap; only the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniforms_ref(seeds: torch.Tensor, offset: int, V: int) -> torch.Tensor:
    """seeds [B] int64 -> u [B, V] fp32 in (0, 1)."""
    s = seeds.long()
    row = mix32_ref(mix32_ref(mix32_ref(s & M32) ^ ((s >> 32) & M32)) ^ (offset & M32))
    h = mix32_ref(row.view(-1, 1) ^ mix32_ref(torch.arange(V, device=seeds.device)).view(1, -1))
    return ((h >> 9).float() + 0.5) * 2.0 ** -23


def ordered_key(z: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 in [0, 2^32) with the same order as the floats (-0 just below +0)."""
    b = z.contiguous().view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF).long() + 2 ** 31


def bisect_ref(keys, weight, target):
    """Largest t (per row) with sum(weight where keys >= t) >= target; 32 bit steps like the kernel."""
    t = torch.zeros(keys.shape[0], dtype=torch.int64, device=keys.device)
    for bit in range(31, -1, -1):
        cand = t | (1 << bit)
        ok = (weight * (keys >= cand.view(-1, 1))).sum(1) >= target
        t = torch.where(ok, cand, t)
    return t


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offset: int):
    """See module docstring; returns [B] int64."""
    _validate(logits, temperature, top_k, top_p, min_p, seeds, offset)
    B, V = logits.shape
    temp = temperature.float().view(B, 1)
    z = logits.float() / torch.where(temp > 0, temp, 1.0)
    zmax = z.amax(1, keepdim=True) if V else z.new_zeros(B, 1)
    p = torch.exp(z - zmax)
    keep = (z > float("-inf")) & (p >= min_p.float().view(B, 1))
    keys = ordered_key(z)
    k = top_k.long().view(B, 1)
    t_k = bisect_ref(keys, keep.float(), k.float().view(B))
    keep &= (keys >= t_k.view(B, 1)) | (k <= 0) | (k >= V)
    mass = (p * keep).sum(1)
    t_p = bisect_ref(keys, p * keep, top_p.float() * mass)
    keep &= (keys >= t_p.view(B, 1)) | (top_p.float().view(B, 1) >= 1)
    g = -torch.log(-torch.log(uniforms_ref(seeds, offset, V)))
    score = torch.where(keep, z + g, float("-inf"))
    tok = torch.where(temp.view(B) > 0, score.argmax(1), logits.float().argmax(1)) if V else torch.full((B,), -1)
    return torch.where(zmax.view(B) > float("-inf"), tok, -1).long()


def _mix32(x):
    x = x ^ T.shift_right(x, T.uint32(16))
    x = x * T.uint32(0x7FEB352D)
    x = x ^ T.shift_right(x, T.uint32(15))
    x = x * T.uint32(0x846CA68B)
    return x ^ T.shift_right(x, T.uint32(16))


def _key(z):
    b = T.reinterpret(z, "int32")
    return T.Cast("int64", T.if_then_else(b >= 0, b, T.bitwise_xor(b, 0x7FFFFFFF))) + T.int64(2 ** 31)


def make_sample(V: int, threads: int):
    """One work item = one row, serial passes over the vocabulary (max, 2 x 32 bisection steps, draw)."""
    B = T.dynamic("B")

    @T.prim_func
    def sample(Logits: T.Tensor((B, V), "float32"), Temp: T.Tensor((B,), "float32"), TopK: T.Tensor((B,), "int32"),
               TopP: T.Tensor((B,), "float32"), MinP: T.Tensor((B,), "float32"), Seeds: T.Tensor((B,), "int64"),
               Offset: T.Tensor((1,), "int64"), Out: T.Tensor((B,), "int64")):
        with T.Kernel(grid(B, threads), threads=threads) as bx:
            b = item(bx, threads)
            f = T.alloc_local((4,), "float32")    # temperature, z max, mass, best score
            t = T.alloc_local((3,), "int64")      # t_k, t_p, candidate
            cnt = T.alloc_local((2,), "int64")    # best index, count
            if b < B:
                f[0] = T.if_then_else(Temp[b] > 0, Temp[b], T.float32(1.0))
                f[1] = -T.infinity("float32")
                cnt[0] = -1
                for v in T.serial(V):                                   # max (greedy: first max)
                    if Logits[b, v] / f[0] > f[1]:
                        f[1] = Logits[b, v] / f[0]
                        cnt[0] = v
                if T.And(Temp[b] > 0, f[1] > -T.infinity("float32")):
                    t[0] = 0
                    if T.And(TopK[b] > 0, TopK[b] < V):
                        for bit in T.serial(32):
                            t[2] = T.bitwise_or(t[0], T.shift_left(T.int64(1), 31 - bit))
                            cnt[1] = 0
                            for v in T.serial(V):
                                z = Logits[b, v] / f[0]
                                if T.And(T.And(z > -T.infinity("float32"), T.exp(z - f[1]) >= MinP[b]), _key(z) >= t[2]):
                                    cnt[1] += 1
                            if cnt[1] >= TopK[b]:
                                t[0] = t[2]
                    t[1] = 0
                    if TopP[b] < 1:
                        f[2] = 0.0
                        for v in T.serial(V):
                            z = Logits[b, v] / f[0]
                            if T.And(T.And(z > -T.infinity("float32"), T.exp(z - f[1]) >= MinP[b]), _key(z) >= t[0]):
                                f[2] += T.exp(z - f[1])
                        f[2] = TopP[b] * f[2]
                        for bit in T.serial(32):
                            t[2] = T.bitwise_or(t[1], T.shift_left(T.int64(1), 31 - bit))
                            f[3] = 0.0
                            for v in T.serial(V):
                                z = Logits[b, v] / f[0]
                                if T.And(T.And(T.And(z > -T.infinity("float32"), T.exp(z - f[1]) >= MinP[b]),
                                               _key(z) >= t[0]), _key(z) >= t[2]):
                                    f[3] += T.exp(z - f[1])
                            if f[3] >= f[2]:
                                t[1] = t[2]
                    s = Seeds[b]
                    row = _mix32(_mix32(_mix32(T.Cast("uint32", T.bitwise_and(s, T.int64(M32))))
                                        ^ T.Cast("uint32", T.bitwise_and(T.shift_right(s, T.int64(32)), T.int64(M32))))
                                 ^ T.Cast("uint32", T.bitwise_and(Offset[0], T.int64(M32))))
                    f[3] = -T.infinity("float32")
                    cnt[0] = -1
                    for v in T.serial(V):
                        z = Logits[b, v] / f[0]
                        h = _mix32(row ^ _mix32(T.Cast("uint32", v)))
                        u = (T.Cast("float32", T.shift_right(h, T.uint32(9))) + T.float32(0.5)) * T.float32(2.0 ** -23)
                        if T.And(T.And(T.And(z > -T.infinity("float32"), T.exp(z - f[1]) >= MinP[b]),
                                       T.And(_key(z) >= t[0], _key(z) >= t[1])), z - T.log(-T.log(u)) > f[3]):
                            f[3] = z - T.log(-T.log(u))
                            cnt[0] = v
                Out[b] = cnt[0]
    return sample


def sample(logits, temperature, top_k, top_p, min_p, seeds, offset: int):
    """TileLang version of sample_ref (same arguments and result)."""
    _validate(logits, temperature, top_k, top_p, min_p, seeds, offset)
    check(logits.dtype == torch.float32, f"sample kernel: logits must be float32, got {logits.dtype}")
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    check(V > 0, "sample: vocabulary is empty")
    dev = logits.device
    off = torch.tensor([offset], dtype=torch.int64, device=dev)
    build(make_sample, target_of(logits, temperature, top_k, top_p, min_p, seeds), V)(
        logits.contiguous(), temperature.float().contiguous(), top_k.int().contiguous(), top_p.float().contiguous(),
        min_p.float().contiguous(), seeds.long().contiguous(), off, out)
    return out


def _validate(logits, temperature, top_k, top_p, min_p, seeds, offset):
    check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16), 2)
    B = logits.shape[0]
    for name, t, dts in [("temperature", temperature, (torch.float32,)), ("top_k", top_k, (torch.int32, torch.int64)),
                         ("top_p", top_p, (torch.float32,)), ("min_p", min_p, (torch.float32,)),
                         ("seeds", seeds, (torch.int64,))]:
        check_tensor(t, name, dts, 1)
        check(t.shape[0] == B, f"sample: {name} has {t.shape[0]} rows for {B} logits rows")
    check(isinstance(offset, int) and offset >= 0, f"sample: offset must be a non-negative int, got {offset!r}")
