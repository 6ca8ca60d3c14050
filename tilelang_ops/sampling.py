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
key() is the fp32 bits as an order-preserving integer (-0 just below +0). The kernel finds t_k and t_p by
32-step bit bisection; the reference selects them directly (top-k, then a sorted cumulative sum), which gives
the same thresholds: t_k exactly, t_p up to the fp32 summation order of the mass (the kernel sums serially).
A row with no logit above -inf returns -1. Logits must not be NaN or +inf.

Uniforms: a counter-based hash (lowbias32, 32-bit multiply-xorshift) of (seed lo, seed hi, offset, token):
  row = mix(mix(mix(seed_lo) ^ seed_hi) ^ offset);  h = mix(row ^ mix(token));  u = ((h >> 9) + .5) * 2^-23
so u is in (0, 1), exact in fp32, and bit-identical on every target. Each row has its own seed and offset
(the engine: a request's seed and the number of tokens its sequence has generated).
"""
import torch
import tilelang.language as T

from tilelang_ops.common import build, check, check_tensor, grid, item, target_of

M32 = 0xFFFFFFFF
KEY_MIN = -2 ** 31   # below every non-NaN key: marks dropped tokens in selections
TOP_P_FIRST = 1024   # top-p candidates tried before sorting whole rows (1024 of 32000: ~7x cheaper)


def mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap; only the low 32 bits are kept).
    In place after the first op: the sampler runs it on [B, V] and allocations dominate otherwise."""
    x = x ^ (x >> 16)
    x.mul_(0x7FEB352D).bitwise_and_(M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x846CA68B).bitwise_and_(M32)
    return x.bitwise_xor_(x >> 16)


def gumbel_ref(seeds: torch.Tensor, offsets: torch.Tensor, V: int) -> torch.Tensor:
    """seeds, offsets [B] int64 -> g = -log(-log(u)) [B, V] fp32 with u the hashed uniforms."""
    s, off = seeds.long(), offsets.long()
    row = mix32_ref(mix32_ref(mix32_ref(s & M32) ^ ((s >> 32) & M32)) ^ (off & M32))
    h = mix32_ref(row.view(-1, 1) ^ mix32_ref(torch.arange(V, device=seeds.device)).view(1, -1))
    u = h.bitwise_right_shift_(9).float().add_(0.5).mul_(2.0 ** -23)
    return u.log_().neg_().log_().neg_()


def ordered_key(z: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 with the same order as the floats (-0 just below +0); NaN excluded."""
    b = z.contiguous().view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def filter_ref(logits, temperature, top_k, top_p, min_p):
    """logits [B, V], per-row parameters [B] -> (z [B, V] fp32 scaled logits, keep [B, V] bool): the tokens
    a sampled row may draw (module docstring; computed for greedy rows too, which ignore it)."""
    B, V = logits.shape
    temp = temperature.float().view(B, 1)
    z = logits.float() / torch.where(temp > 0, temp, 1.0)
    p = torch.exp(z - z.amax(1, keepdim=True))
    keep = (z > float("-inf")) & (p >= min_p.float().view(B, 1))
    # Only rows that use top-k / top-p pay for the selections (most requests use neither).
    k = top_k.long()
    k_rows = ((k > 0) & (k < V)).nonzero()[:, 0]
    p_rows = (top_p.float() < 1).nonzero()[:, 0]
    if len(k_rows) or len(p_rows):
        key = ordered_key(z)
    if len(k_rows):
        keep[k_rows] &= key[k_rows] >= _kth_kept_key(key[k_rows], keep[k_rows], k[k_rows])
    if len(p_rows):
        kept = keep[p_rows]
        mass = torch.where(kept, p[p_rows], 0.0)
        keep[p_rows] &= key[p_rows] >= _top_p_key(key[p_rows], mass, kept, top_p[p_rows])
    return z, keep


def _kth_kept_key(key, keep, k):
    """key, keep [R, V], k [R] in [1, V) -> t_k [R, 1]; KEY_MIN (keep all) when fewer than k are kept."""
    kept = torch.where(keep, key, KEY_MIN)
    return kept.topk(int(k.max()), 1).values.gather(1, k.view(-1, 1) - 1)


def _top_p_key(key, mass, keep, top_p):
    """key, mass (exp(z - max z) where kept, else 0), keep [R, V], top_p [R] -> t_p [R, 1]: the key of the first
    token, in descending order, whose cumulative mass reaches top_p of the total (ties come out together)."""
    key = torch.where(keep, key, KEY_MIN)
    target = top_p.float().view(-1, 1) * mass.sum(1, keepdim=True)
    n = max(int(keep.sum(1).max()), 1)
    t, reached = _first_reaching(key, mass, target, min(n, TOP_P_FIRST))
    rest = (~reached).nonzero()[:, 0]
    if n > TOP_P_FIRST and len(rest):
        # Only rows whose top_p mass lies deeper pay for sorting every kept token. Ties have equal mass, so
        # the cumulative sums of the first TOP_P_FIRST are the full sort's whatever order ties come in.
        t[rest] = _first_reaching(key[rest], mass[rest], target[rest], n)[0]
    return t


def _first_reaching(key, mass, target, K):
    """key, mass [R, V], target [R, 1] -> (t [R, 1], reached [R]): among the K largest keys, the first whose
    cumulative mass reaches target; else the K-th (with K = all kept: keep all, as rounding can leave the sorted
    sum a hair below a target near the total)."""
    top = key.topk(K, 1)
    first = (mass.gather(1, top.indices).cumsum(1) < target).sum(1, keepdim=True)
    return top.values.gather(1, first.clamp(max=K - 1)), first[:, 0] < K


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """See module docstring; seeds, offsets [B] int64; returns [B] int64."""
    _validate(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    B, V = logits.shape
    if V == 0:
        return torch.full((B,), -1, dtype=torch.int64, device=logits.device)
    z, keep = filter_ref(logits, temperature, top_k, top_p, min_p)
    score = gumbel_ref(seeds, offsets, V).add_(z).masked_fill_(~keep, float("-inf"))
    tok = torch.where(temperature.view(B) > 0, score.argmax(1), logits.float().argmax(1))
    return torch.where((z > float("-inf")).any(1), tok, -1)


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
               Offset: T.Tensor((B,), "int64"), Out: T.Tensor((B,), "int64")):
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
                                 ^ T.Cast("uint32", T.bitwise_and(Offset[b], T.int64(M32))))
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


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """TileLang version of sample_ref (same arguments and result)."""
    _validate(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    check(logits.dtype == torch.float32, f"sample kernel: logits must be float32, got {logits.dtype}")
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    check(V > 0, "sample: vocabulary is empty")
    build(make_sample, target_of(logits, temperature, top_k, top_p, min_p, seeds, offsets), V)(
        logits.contiguous(), temperature.float().contiguous(), top_k.int().contiguous(), top_p.float().contiguous(),
        min_p.float().contiguous(), seeds.long().contiguous(), offsets.long().contiguous(), out)
    return out


def _validate(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16), 2)
    B = logits.shape[0]
    for name, t, dts in [("temperature", temperature, (torch.float32,)), ("top_k", top_k, (torch.int32, torch.int64)),
                         ("top_p", top_p, (torch.float32,)), ("min_p", min_p, (torch.float32,)),
                         ("seeds", seeds, (torch.int64,)), ("offsets", offsets, (torch.int64,))]:
        check_tensor(t, name, dts, 1)
        check(t.shape[0] == B, f"sample: {name} has {t.shape[0]} rows for {B} logits rows")
