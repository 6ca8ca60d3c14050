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
key() is the fp32 bits as an order-preserving integer (-0 just below +0). The kernel (one block per row,
the row walked in tiles) finds t_k and t_p by radix select: 4 passes of 8 key bits each, a 256-bin histogram
of counts / masses per pass; the reference selects them directly (top-k, then a sorted cumulative sum), which
gives the same thresholds: t_k exactly, t_p up to the fp32 summation order of the mass (the kernel sums into
bins: serially on the C target, by atomics in any order on the GPU). t_p is a kept token's key (top_p 0: the
top token). A row with no logit above -inf returns -1. Logits must not be NaN or +inf.

Uniforms: a counter-based hash (lowbias32, 32-bit multiply-xorshift) of (seed lo, seed hi, offset, token):
  row = mix(mix(mix(seed_lo) ^ seed_hi) ^ offset);  h = mix(row ^ mix(token));  u = ((h >> 9) + .5) * 2^-23
so u is in (0, 1), exact in fp32, and bit-identical on every target. Each row has its own seed and offset
(the engine: a request's seed and the number of tokens its sequence has generated).
"""
import torch
import tilelang.language as T

from tilelang_ops.args import check, check_sample
from tilelang_ops.common import Tiles, build, target_of

M32 = 0xFFFFFFFF
KEY_MIN = -2 ** 31   # below every non-NaN key: marks dropped tokens in selections
TOP_P_FIRST = 1024   # top-p candidates tried before sorting whole rows (1024 of 32000: ~7x cheaper)
THREADS = 1024       # CUDA block: one per row
VEC = 4              # fp32 per thread per tile: one 16-byte load
TILE = THREADS * VEC  # tokens per tile (the C target walks the same tiles serially)
BITS = 8             # radix select: DIGITS digits of BITS bits of the 32-bit key, a BINS-bin histogram each
DIGITS = 32 // BITS
BINS = 1 << BITS


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
    check_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
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


@T.macro
def _row_hash(seed, offset, row):
    """row[0] = the uint32 hash of a row's (seed, offset) (module docstring). One lowbias32 per statement:
    nested, each would repeat its argument 8 times in the expression tree (and in the generated code)."""
    row[0] = _mix32(T.Cast("uint32", T.bitwise_and(seed, T.int64(M32))))
    row[0] = _mix32(row[0] ^ T.Cast("uint32", T.bitwise_and(T.shift_right(seed, T.int64(32)), T.int64(M32))))
    row[0] = _mix32(row[0] ^ T.Cast("uint32", T.bitwise_and(offset, T.int64(M32))))


def _gumbel(z, h):
    """z - log(-log(u)), u the uniform of the token whose hash is h."""
    u = (T.Cast("float32", T.shift_right(h, T.uint32(9))) + T.float32(0.5)) * T.float32(2.0 ** -23)
    return z - T.log(-T.log(u))


def make_sample(V: int, target: str):
    """Logits [B, V] -> Out [B]: one block per row, the row walked in tiles of TILE tokens (VEC per thread,
    one 16-byte load each). Passes over the row: max (greedy rows stop there), DIGITS radix passes for t_k
    (top-k rows), DIGITS for t_p (top-p rows), the draw."""
    check(V < 2 ** 24, "sample kernel: the histograms count tokens in fp32, exact below 2^24")
    tl = Tiles(target, THREADS)
    NT = (V + TILE - 1) // TILE
    B = T.dynamic("B")
    NEG = -T.infinity("float32")

    @T.macro
    def load_z(Logits, b, it, temp, tile):
        """tile = z of tile it of row b (the tail past V is padded: callers mask it with v < V)."""
        T.copy(Logits[b, it * TILE:(it + 1) * TILE], tile)
        for i in tl.parallel(TILE):
            tile[i] = tile[i] / temp[0]

    def kept_by(zmax, min_p, tkey):
        """The row's filter so far as a predicate of (token v, its z): above -inf, min_p, key >= tkey[0]."""
        return lambda v, z: T.And(T.And(v < V, z > NEG), T.And(T.exp(z - zmax[0]) >= min_p, _key(z) >= tkey[0]))

    @T.macro
    def mask_tail(it, tile):
        """tile: z -> the greedy score, z or -inf past V."""
        for i in tl.parallel(TILE):
            tile[i] = T.if_then_else(it * TILE + i < V, tile[i], NEG)

    @T.macro
    def gumbel_scores(it, tile, h, row, kept):
        """tile: z -> z - log(-log(u)) where kept, else -inf; h [TILE] uint32 scratch for the hashes."""
        for i in tl.parallel(TILE):
            h[i] = _mix32(T.Cast("uint32", it * TILE + i))
        for i in tl.parallel(TILE):
            h[i] = _mix32(row[0] ^ h[i])
        for i in tl.parallel(TILE):
            tile[i] = T.if_then_else(kept(it * TILE + i, tile[i]), _gumbel(tile[i], h[i]), NEG)

    @T.macro
    def first_argmax(Logits, b, temp, scores, top, at):
        """top[0], at[0] = the max over the row of the scores(it, tile) makes of each tile's z, and its first
        token (-inf, -1 if none beats -inf). Per-lane best and first index, then two block reductions."""
        tile = tl.fragment((TILE,), "float32")
        best = tl.fragment((TILE,), "float32")
        idx = tl.fragment((TILE,), "int32")
        red_f = tl.fragment((1,), "float32")
        red_i = tl.fragment((1,), "int32")
        T.fill(best, NEG)
        T.fill(idx, -1)
        for it in T.serial(NT):
            load_z(Logits, b, it, temp, tile)
            scores(it, tile)
            for i in tl.parallel(TILE):
                # idx before best, strict >: a lane keeps its first index (and TileLang may split the loop)
                idx[i] = T.if_then_else(tile[i] > best[i], it * TILE + i, idx[i])
                best[i] = T.max(best[i], tile[i])
        tl.reduce_max(best, red_f, 0)
        for i in tl.parallel(TILE):
            idx[i] = T.if_then_else(best[i] == red_f[0], idx[i], V)
        tl.reduce_min(idx, red_i, 0)
        top[0] = red_f[0]
        at[0] = red_i[0]

    @T.macro
    def radix_select(Logits, b, temp, kept, weight, target_of_total, tkey):
        """Raise tkey[0] to t, the largest key with sum(weight(z) of kept tokens with key >= t) >= target
        (target_of_total(the whole kept weight)); t is a kept token's key. One histogram pass per digit,
        most significant first, each over the tokens matching the digits chosen so far. If the bins fall
        short of the target (all of them: fewer than top_k kept; or a later level by fp32 rounding) the
        tokens matching the prefix so far are all kept."""
        tile = tl.fragment((TILE,), "float32")
        key = tl.fragment((TILE,), "int64")          # -1 (matching no prefix) where not kept
        hist = tl.shared((BINS,), "float32")
        sel = T.alloc_local((1,), "int64")            # the digits chosen so far, lower ones 0
        live = T.alloc_local((1,), "int32")           # 0 once a level fell short
        digit = T.alloc_local((1,), "int32")
        need = T.alloc_local((1,), "float32")         # the target
        above = T.alloc_local((1,), "float32")        # weight of the keys above the chosen prefix
        run = T.alloc_local((1,), "float32")          # running bin sum of a scan
        sel[0] = 0
        above[0] = 0
        live[0] = 1
        for level in T.serial(DIGITS):
            if live[0] == 1:
                low = T.Cast("int64", BITS * (DIGITS - 1 - level))
                T.fill(hist, 0)
                for it in T.serial(NT):
                    load_z(Logits, b, it, temp, tile)
                    for i in tl.parallel(TILE):
                        key[i] = T.if_then_else(kept(it * TILE + i, tile[i]), _key(tile[i]), -1)
                    for i in tl.parallel(TILE):
                        if T.shift_right(key[i], low + BITS) == T.shift_right(sel[0], low + BITS):
                            T.atomic_add(hist[T.Cast("int32", T.bitwise_and(T.shift_right(key[i], low), BINS - 1))],
                                         weight(tile[i]))
                if level == 0:
                    # summed in the scan's order: the scan then surely reaches a target <= the total
                    run[0] = 0
                    for j in T.serial(BINS):
                        run[0] = run[0] + hist[BINS - 1 - j]
                    need[0] = target_of_total(run[0])
                digit[0] = -1
                run[0] = 0
                for j in T.serial(BINS):
                    if digit[0] < 0:
                        # an empty bin never ends the scan: a target of 0 (top_p 0) keeps the top token
                        if T.And(hist[BINS - 1 - j] > 0, above[0] + (run[0] + hist[BINS - 1 - j]) >= need[0]):
                            digit[0] = BINS - 1 - j
                            above[0] = above[0] + run[0]
                        else:
                            run[0] = run[0] + hist[BINS - 1 - j]
                if digit[0] < 0:
                    live[0] = 0
                else:
                    sel[0] = T.bitwise_or(sel[0], T.shift_left(T.Cast("int64", digit[0]), low))
        tkey[0] = T.max(tkey[0], sel[0])

    @T.prim_func
    def sample(Logits: T.Tensor((B, V), "float32"), Temp: T.Tensor((B,), "float32"), TopK: T.Tensor((B,), "int32"),
               TopP: T.Tensor((B,), "float32"), MinP: T.Tensor((B,), "float32"), Seeds: T.Tensor((B,), "int64"),
               Offset: T.Tensor((B,), "int64"), Out: T.Tensor((B,), "int64")):
        with tl.kernel(B) as b:
            temp = T.alloc_local((1,), "float32")
            zmax = T.alloc_local((1,), "float32")
            score = T.alloc_local((1,), "float32")        # the drawn token's score (unused)
            tok = T.alloc_local((1,), "int32")
            tkey = T.alloc_local((1,), "int64")           # kept tokens have key >= tkey[0]
            row = T.alloc_local((1,), "uint32")
            h = tl.fragment((TILE,), "uint32")
            temp[0] = T.if_then_else(Temp[b] > 0, Temp[b], T.float32(1.0))
            first_argmax(Logits, b, temp, mask_tail, zmax, tok)
            if T.And(Temp[b] > 0, zmax[0] > NEG):
                tkey[0] = 0
                kept = kept_by(zmax, MinP[b], tkey)
                # top-k (s 0: count top_k kept tokens), then top-p (s 1: their mass reaches top_p of it all);
                # one loop rather than two calls halves the code TileLang lowers
                for s in T.serial(2):
                    if T.if_then_else(s == 0, T.And(TopK[b] > 0, TopK[b] < V), TopP[b] < 1):
                        radix_select(Logits, b, temp, kept,
                                     lambda z: T.if_then_else(s == 0, T.float32(1), T.exp(z - zmax[0])),
                                     lambda total: T.if_then_else(s == 0, T.Cast("float32", TopK[b]), TopP[b] * total),
                                     tkey)
                _row_hash(Seeds[b], Offset[b], row)
                first_argmax(Logits, b, temp, lambda it, tile: gumbel_scores(it, tile, h, row, kept), score, tok)
            Out[b] = T.Cast("int64", tok[0])
    return sample


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """TileLang version of sample_ref (same arguments and result)."""
    check_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
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
