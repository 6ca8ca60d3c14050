"""DeepSeek-V4 attention over deepinfer's two pools (the math of transformers' DeepseekV4Attention).

Every layer is shared-KV MQA (one KV head read as both key and value) with low-rank Q, partial
interleaved RoPE on the trailing `rope_dim` channels, a per-head attention sink and a grouped low-rank
output projection. What a query attends to depends on the layer type:

  sliding_attention            the last `sliding_window` tokens (itself included)
  compressed_sparse_attention  the same window + the compressed entries (1 per m source tokens, each
                               pooled over an overlapping 2m-token window) the Lightning Indexer picks
                               for this query (top `index_topk`)
  heavily_compressed_attention the same window + every compressed entry (1 per m' source tokens)

A compressed entry w pools source tokens up to (w+1)*m - 1, so query t sees entries w < (t+1) // m: the
window a token closes is visible to that token.

Where things live:
  paged pool  compressed entries (CSA main KV, HCA KV, indexer keys): entry w of a sequence sits in block
              block_table[w // per_block] at row w % per_block, per_block = block_size / m. Exact (model
              dtype), FP8 or FP4 (NVFP4 main KV, MXFP4 indexer keys): quantised on write, dequantised on read.
  state pool  per sequence, every tensor a ring indexed by POSITION (row = position % its length):
              the SWA ring (sliding_window + mb rows of K=V; exact, FP8 or NVFP4 as kv_cache_dtype says,
              read through the same EntryPool as the entries), the CSA and indexer compressors' raw rings
              (2 * rate + mb rows of kv and raw gate: the previous window for its Ca half and the current
              one), the HCA accumulator ring (mb rows: the online-softmax state after each position).
              mb = max_backtracking = draft tokens + 1 (1 without speculation).
Nothing reads a ring row this sequence has not written in its current life (every read is bounded by
positions), so a reused state slot needs no reset. Because rows are keyed by position, rolling back
rejected draft tokens is free: the scheduler shortens the sequence, and the rows those tokens wrote are
either rewritten before anything reads them or never read (see write_ring).
"""
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.formats import fp4, fp8
from deepinfer.layers import cpu_ops
from deepinfer.layers.hyper_connection import unweighted_rms_norm

from deepinfer.layers.linear import linear  # bf16 weights -> C++ AVX2 GEMM (torch's bf16 matmul is ~8 GFLOP/s here)
from tilelang_ops.dispatch import get_op

PREFILL_QUERY_CHUNK = 256  # queries per dense attention tile in prefill: bounds the [H, C, K] score tile


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepseekV4RMSNorm: statistic and fp32 weight applied in fp32, one cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing rd channels of x [T, ..., D]; cos/sin [T, rd] as Rope returns them
    (each frequency twice, fp32); inverse rotates back (sin negated). fp32 math, result in x's dtype (as the
    reference); on the CPU one C++ call with the same bits (csrc/cpu/norm_rope.h)."""
    if cpu_ops.fast_path(x):
        return cpu_ops.rope_interleaved(x, cos, sin, inverse)
    rd = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    cos, sin = cos.view(shape), (-sin if inverse else sin).view(shape)
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope * cos + rotated * sin).to(x.dtype)], dim=-1)


class Rope:
    """One rope type (V4 has `main` for sliding layers and `compress` for CSA/HCA layers and compressors)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        self.inv_freq = inv_freq.float().repeat_interleave(2)  # interleaved pairs share a frequency
        self.scaling = attention_scaling

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, rd]: rounded to dtype as the reference casts them to the activation
        dtype, then held in fp32, the dtype apply_rope's math runs in, so no call converts them again."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return (freqs.cos() * self.scaling).to(dtype).float(), (freqs.sin() * self.scaling).to(dtype).float()


def write_ring(ring: torch.Tensor, slot: int, p0: int, values: torch.Tensor) -> None:
    """ring [slots, L, ...]: store values [S, ...] of positions p0..p0+S-1 at rows position % L of `slot`
    (only the last L can be read again).

    Why a ring of L >= need + mb - 1 rows survives rollback, where a step starting at position p reads
    the rows of positions p - need .. p - 1 (SWA: need = window - 1; CSA: 2 * rate - 1, the oldest source
    of a window the step may close; HCA: 1) and mb = max_backtracking: the sequence never shrinks below
    an accepted token, so every earlier step started at most at p - 1 and wrote positions below
    p - 1 + mb, accepted or rejected. A row of position q >= p - need was last written by q itself unless
    some step wrote q + k * L (k >= 1) >= p - need + L >= p + mb - 1: none did. Rows of positions >= p
    (rejected drafts included) are rewritten by the step that reaches them before anything reads them,
    as every read is bounded by the reading query's position."""
    keep, rows = ring_rows(ring.shape[1], p0, values.shape[0])
    ring[slot, rows] = values[keep:]


def ring_rows(L: int, p0: int, S: int) -> tuple[int, torch.Tensor]:
    """Positions p0..p0+S-1 into a ring of L rows -> (how many leading ones to skip, rows of the rest)."""
    keep = max(0, S - L)
    return keep, torch.arange(p0 + keep, p0 + S) % L


def _param(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """Bias-free projection with the checkpoint's parameter name `weight` [out, in]."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    """Weighted RMSNorm, weight kept in fp32 like the checkpoint."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class EntryPool:
    """Rows of D values in a pool tensor of [n, per_block, ...]: one layer's compressed entries in the paged
    pool (n = blocks, per_block = entries per block) or its SWA ring in the state pool (n = sequence slots,
    per_block = ring length). A flat row is n_index * per_block + offset. Formats: data [n, per_block, D]
    in the model dtype ('auto'); E4M3 bytes [n, per_block, D] plus an fp32 scale [n, per_block, 1] per row
    ('fp8', deepinfer/formats/fp8.py); packed uint8 [n, per_block, D/2] plus scale [n, per_block, D/16 |
    D/32] ('nvfp4' | 'mxfp4', deepinfer/formats/fp4.py)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, fmt: str, dtype: torch.dtype):
        self.data, self.scale, self.fmt, self.dtype = data, scale, fmt, dtype
        self.per_block = data.shape[1]
        # On the CPU quantised rows go straight to csrc/cpu/kv_quant (one call per read or write, rows as
        # given). Elsewhere FP4 goes through tilelang_ops' dispatch (the TileLang kernels on CUDA); read() gets
        # flat pool rows (callers resolve block tables with rows()), so to kv_load the pool is one sequence
        # owning every block in order: its entry positions are the pool rows.
        self.kv_store, self.kv_load = get_op("kv_store"), get_op("kv_load")
        self.all_blocks = torch.arange(data.shape[0], device=data.device).view(1, -1)

    def rows(self, block_tables: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """block_tables [B, M], entry indices w [B, E] -> flat pool rows [B, E] (padding maps to row 0)."""
        col = (w // self.per_block).clamp(max=block_tables.shape[1] - 1)
        block = block_tables.gather(1, col).clamp(min=0)
        return block * self.per_block + w % self.per_block

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """rows [N], values [N, D]."""
        if self.fmt == "auto":
            self.data.view(-1, self.data.shape[-1])[rows] = values.to(self.data.dtype)
        elif self.data.device.type == "cpu":
            cpu_ops.store_rows(values, rows, self.data, self.scale, self.fmt)
        elif self.fmt == "fp8":
            q, scale = fp8.quantize_fp8(values)
            self.data.view(-1, self.data.shape[-1])[rows] = q
            self.scale.view(-1, 1)[rows] = scale
        else:
            self.kv_store(values, rows, self.data, self.scale, self.fmt)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [...] -> entries [..., D] in the model dtype."""
        flat = rows.reshape(-1)
        if self.fmt == "auto":
            entries = self.data.view(-1, self.data.shape[-1]).index_select(0, flat)
        elif self.data.device.type == "cpu":
            return cpu_ops.load_rows(self.data, self.scale, rows, self.fmt, self.dtype)
        elif self.fmt == "fp8":
            q = self.data.view(-1, self.data.shape[-1]).index_select(0, flat)
            entries = fp8.dequantize_fp8(q, self.scale.view(-1, 1).index_select(0, flat), self.dtype)
        else:
            entries, _ = self.kv_load(self.data, self.scale, self.all_blocks, flat[None], self.fmt, dtype=self.dtype)
        return entries.view(*rows.shape, entries.shape[-1])

    def roundtrip(self, values: torch.Tensor) -> torch.Tensor:
        """values [N, D] as read() would return them after write(): what a query sees of keys it takes
        straight from this step's projections, so that prefill, decode and chunked prefill agree."""
        if self.fmt == "auto":
            return values.to(self.data.dtype).to(self.dtype)
        if self.fmt == "fp8":
            return fp8.dequantize_fp8(*fp8.quantize_fp8(values), self.dtype)
        quantize, dequantize = FP4_CODECS[self.fmt]
        return dequantize(*quantize(values), dtype=self.dtype)


FP4_CODECS = {"nvfp4": (fp4.quantize_nvfp4, fp4.dequantize_nvfp4), "mxfp4": (fp4.quantize_mxfp4, fp4.dequantize_mxfp4)}


class Compressor(nn.Module):
    """Softmax-gated pooling of source tokens into compressed entries (DeepseekV4HCACompressor /
    DeepseekV4CSACompressor / the indexer's own compressor).

    HCA (overlap=False): entry w = sum over window w's `rate` tokens of softmax(gate + bias) * kv.
    CSA (overlap=True): kv/gate are 2*dim wide: Ca = [:dim], Cb = [dim:]. Entry w pools window w-1's Ca and
    window w's Cb (2*rate slots, stride rate); window 0 has no Ca part (zero kv, -inf gate).
    Then RMSNorm and RoPE at the window's first source position w * rate.

    State (per sequence, CSA): kv_ring / gate_ring [L, 2*dim], L = 2*rate + mb, the raw kv and gate of
    position p at row p % L. The window closing at position (w+1)*rate - 1 is pooled from the rows of
    positions (w-1)*rate .. (w+1)*rate - 1, which rolled-back drafts never clobber (write_ring: need is
    2*rate - 1). An entry a rejected draft closed stays in the paged pool at index w, but queries read
    entries w < (pos+1) // rate only, so none reads it before the accepted token at (w+1)*rate - 1
    rewrites it (in its own step, before that step's reads).
    """

    def __init__(self, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = Linear(hidden_size, width, dtype)
        self.gate_proj = Linear(hidden_size, width, dtype)
        self.position_bias = _param(rate, width, dtype=torch.float32)
        self.kv_norm = RMSNorm(dim, eps)
        self.rope: Rope | None = None
        self.pool: EntryPool | None = None
        self.kv_ring = self.gate_ring = None  # state pool [slots, L, 2*dim]

    def bind(self, pool: EntryPool, kv_ring: torch.Tensor, gate_ring: torch.Tensor) -> None:
        self.pool, self.kv_ring, self.gate_ring = pool, kv_ring, gate_ring

    def pool_windows(self, kv, gate_raw, window_ids) -> torch.Tensor:
        """kv, gate_raw [n, m, width] of windows window_ids [n] -> entries [n, dim] (normed, roped).
        HCA: m = rate, the window's tokens. CSA: m = 2*rate, positions (w-1)*rate .. (w+1)*rate - 1: the
        first rate rows give their Ca half (window 0 has none: those rows are ignored), the rest their Cb."""
        r = self.rate
        gate = gate_raw + self.position_bias.repeat(kv.shape[1] // r, 1)  # fp32, as the reference
        if self.overlap:
            d, first = self.dim, (window_ids == 0)[:, None, None]
            kv = torch.cat([kv[:, :r, :d].masked_fill(first, 0.0), kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d].masked_fill(first, float("-inf")), gate[:, r:, d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        entries = self.kv_norm(pooled)
        cos, sin = self.rope(window_ids * self.rate, entries.dtype)
        return apply_rope(entries, cos, sin)

    def prefill_update(self, kv, gate, p0: int, slot: int, block_table: torch.Tensor, emit: bool = True) -> None:
        """One sequence's S new tokens at positions p0.. (kv, gate [S, 2*dim]): emit every window they close
        into the paged pool (unless `emit` is False: replay keeps the exact entries already there), then
        keep them in the ring."""
        r = self.rate
        w0, w1 = p0 // r, (p0 + kv.shape[0]) // r  # the windows this chunk closes
        if emit and w1 > w0:
            # their sources before p0 (window 0's Ca rows hold no position: pool_windows ignores them)
            held = torch.arange((w0 - 1) * r, p0) % self.kv_ring.shape[1]
            ids = torch.arange(w0, w1)
            span_kv = torch.cat([self.kv_ring[slot, held], kv[: w1 * r - p0]])
            span_gate = torch.cat([self.gate_ring[slot, held], gate[: w1 * r - p0]])
            entries = self.pool_windows(_window_pairs(span_kv, r), _window_pairs(span_gate, r), ids)
            self._store(entries, block_table.expand(len(ids), -1), ids)
        write_ring(self.kv_ring, slot, p0, kv)
        write_ring(self.gate_ring, slot, p0, gate)

    def decode_update(self, kv, gate, positions, slots, block_tables) -> None:
        """N rows (kv, gate [N, 2*dim], positions/slots [N], block_tables [N, M]), a verify step's several
        consecutive positions of a sequence among them: all into the ring, then every row that closes a
        window emits that entry. Writing first is safe: a step writes positions p0..p0 + l (l < mb), which
        clobber rows of positions <= p0 + l - L < p0 - 2*rate, older than any source of a window it closes,
        and the rows it pools (up to the closing position) were all written by then."""
        r, L = self.rate, self.kv_ring.shape[1]
        self.kv_ring[slots, positions % L] = kv
        self.gate_ring[slots, positions % L] = gate
        done = ((positions + 1) % r == 0).nonzero().flatten()
        if done.numel() == 0:
            return
        ids = positions[done] // r
        rows = ((ids[:, None] - 1) * r + torch.arange(2 * r)) % L  # [n, 2r]: the window's sources
        s = slots[done, None]
        self._store(self.pool_windows(self.kv_ring[s, rows], self.gate_ring[s, rows], ids), block_tables[done], ids)

    def _store(self, entries: torch.Tensor, block_tables: torch.Tensor, window_ids: torch.Tensor) -> None:
        """entries [n, dim] of windows window_ids [n] of the sequences with block_tables [n, M]."""
        self.pool.write(self.pool.rows(block_tables, window_ids[:, None])[:, 0], entries)


def _window_pairs(span: torch.Tensor, rate: int) -> torch.Tensor:
    """span [(n+1)*rate, width] of consecutive windows -> [n, 2*rate, width]: each window after the first
    preceded by the one before it (CSA's Ca + Cb sources)."""
    windows = span.view(-1, rate, span.shape[-1])
    return torch.cat([windows[:-1], windows[1:]], dim=1)


class HCACompressor(Compressor):
    """HCA compressor (no overlap, rate m' = 128) whose unfinished window is kept as an online-softmax
    accumulator instead of its raw tokens: per channel the running max of gate + bias, the running sum of
    exp(gate + bias - max) and of kv * exp(...), all fp32, [3, D] (1.5 KB at D = 128 instead of 2 * m' * D
    model-dtype values: 64 KB in bf16). Windows that a single prefill covers are pooled exactly as the
    reference; a window spanning steps is pooled online, which equals the reference's softmax up to fp32
    rounding.

    State (per sequence): acc [mb, 3, D], row p % mb = the accumulator after position p (over p's window up
    to p). A step starting at position p resumes from row (p - 1) % mb unless p starts a window; after a
    verify step the next one may start after any of its last mb positions, so every step records them all
    (write_ring: need is 1, L = mb)."""

    def __init__(self, hidden_size: int, dim: int, rate: int, eps: float, dtype: torch.dtype):
        super().__init__(hidden_size, dim, rate, False, eps, dtype)
        self.acc: torch.Tensor | None = None  # state pool [slots, mb, 3, D] fp32: max, denominator, numerator

    def bind(self, pool: EntryPool, acc: torch.Tensor) -> None:
        self.pool, self.acc = pool, acc

    @staticmethod
    def merge(acc: torch.Tensor, kv: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
        """acc [..., 3, D]; kv, logit [..., n, D] (fp32 logit = gate + bias) -> acc with the n tokens added."""
        if kv.shape[-2] == 0:
            return acc
        m_old, s_old, num_old = acc.unbind(-2)
        m = torch.maximum(m_old, logit.amax(dim=-2))
        old = torch.exp(m_old - m)  # 0 for an empty accumulator (m_old = -inf)
        w = torch.exp(logit - m.unsqueeze(-2))
        s = s_old * old + w.sum(dim=-2)
        num = num_old * old + (kv.float() * w).sum(dim=-2)
        return torch.stack([m, s, num], dim=-2)

    def empty(self, *batch) -> torch.Tensor:
        acc = torch.zeros(*batch, 3, self.dim)
        acc[..., 0, :] = float("-inf")
        return acc

    def finish(self, acc: torch.Tensor, window_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """acc [n, 3, D] of complete windows -> entries [n, D] (normed, roped)."""
        entries = self.kv_norm((acc[:, 2] / acc[:, 1]).to(dtype))
        cos, sin = self.rope(window_ids * self.rate, entries.dtype)
        return apply_rope(entries, cos, sin)

    def prefill_update(self, kv, gate, p0: int, slot: int, block_table: torch.Tensor, emit: bool = True) -> None:
        """One sequence's S new tokens at positions p0.. (kv, gate [S, D]): emit the windows they close
        (unless `emit` is False: replay), record the accumulators of the last min(S, mb) positions."""
        logit = gate + self.position_bias[torch.arange(p0, p0 + kv.shape[0]) % self.rate]
        # the window this sequence left unfinished (replay: it began before the span; nothing reads it again)
        prev = self.acc[slot, (p0 - 1) % self.acc.shape[1]] if emit and p0 % self.rate else self.empty()
        if emit:
            self._emit_chunk(kv, gate, logit, prev, p0, block_table)
        self._record(kv, logit, prev, p0, slot)

    def _emit_chunk(self, kv, gate, logit, prev, p0: int, block_table: torch.Tensor) -> None:
        """The windows tokens p0.. close: the one begun before p0 online from `prev`, whole ones exactly."""
        r, S = self.rate, kv.shape[0]
        w0, w1 = p0 // r, (p0 + S) // r
        if w1 == w0:
            return
        head = -p0 % r  # tokens that finish the window this sequence left unfinished
        parts = []
        if head:
            parts.append(self.finish(self.merge(prev, kv[:head], logit[:head])[None], torch.tensor([w0]), kv.dtype))
        n = w1 - w0 - (1 if head else 0)
        if n:
            body = slice(head, head + n * r)
            ids = torch.arange(w1 - n, w1)
            parts.append(self.pool_windows(kv[body].view(n, r, -1), gate[body].view(n, r, -1), ids))
        ids = torch.arange(w0, w1)
        self._store(torch.cat(parts), block_table.expand(len(ids), -1), ids)

    def _record(self, kv, logit, prev, p0: int, slot: int) -> None:
        """Accumulators after each of the last m = min(S, mb) positions -> ring: the tokens of the first
        one's window before it merged at once, then the m tokens one at a time, each merge giving the next
        recorded accumulator."""
        r, S = self.rate, kv.shape[0]
        q = p0 + S - min(S, self.acc.shape[1])  # first recorded position
        ws = max(q - q % r, p0)  # the first token of q's window in this chunk
        acc = self.merge(prev if ws == p0 else self.empty(), kv[ws - p0:q - p0], logit[ws - p0:q - p0])
        out = []
        for t in range(q - p0, S):
            if (p0 + t) % r == 0:
                acc = self.empty()
            acc = self.merge(acc, kv[t:t + 1], logit[t:t + 1])
            out.append(acc)
        write_ring(self.acc, slot, q, torch.stack(out))

    def decode_update(self, kv, gate, positions, slots, block_tables) -> None:
        """N rows as Compressor.decode_update's. Row p's accumulator extends row p - 1's, so a verify step's
        rows go in waves by their offset in the sequence (at most mb), each wave a batch of one-row steps:
        the same merges, in the same order, as that many decode steps. Wave j writes the ring row wave j + 1
        reads; the only older row read, (p0 - 1) % mb, is read by wave 0 before wave mb - 1 may reuse it."""
        offsets = _run_offsets(slots)
        for j in range(int(offsets.max()) + 1):
            rows = (offsets == j).nonzero().flatten()
            self._decode_wave(kv[rows], gate[rows], positions[rows], slots[rows], block_tables[rows])

    def _decode_wave(self, kv, gate, positions, slots, block_tables) -> None:
        """At most one row per sequence, its previous position's accumulator already in the ring."""
        r, mb = self.rate, self.acc.shape[1]
        col = positions % r
        acc = self.acc[slots, (positions - 1) % mb]
        acc = torch.where((col == 0)[:, None, None], self.empty(len(slots)), acc)  # a new window starts
        acc = self.merge(acc, kv[:, None], (gate + self.position_bias[col])[:, None])
        self.acc[slots, positions % mb] = acc
        done = (col == r - 1).nonzero().flatten()
        if done.numel():
            ids = positions[done] // r
            self._store(self.finish(acc[done], ids, kv.dtype), block_tables[done], ids)


def _run_offsets(slots: torch.Tensor) -> torch.Tensor:
    """slots [N] -> each row's offset in its sequence's rows (a step's rows of one sequence are
    consecutive and share its state slot, which no other sequence of the step has)."""
    i = torch.arange(slots.shape[0])
    first = torch.ones_like(slots, dtype=torch.bool)
    first[1:] = slots[1:] != slots[:-1]
    return i - torch.where(first, i, 0).cummax(0).values


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int, dtype: torch.dtype):
        super().__init__()
        self.weights_proj = Linear(hidden_size, n_heads, dtype)


class Indexer(Compressor):
    """Lightning Indexer: its own CSA-style compressor at index_head_dim (keys), plus queries from the
    attention's low-rank q. score(t, w) = sum_h weight_{t,h} * ReLU(q_{t,h} . k_w) * index_head_dim^-0.5,
    weight = weights_proj(x) * n_heads^-0.5. Each query keeps its top `topk` causally visible entries."""

    def __init__(self, cfg, rate: int, dtype: torch.dtype):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, rate, True, cfg.rms_norm_eps, dtype)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype)
        self.scorer = IndexerScorer(cfg.hidden_size, cfg.index_n_heads, dtype)

    def scores(self, q_res, head_w, cos, sin, keys) -> torch.Tensor:
        """q_res [N, q_lora], head_w [N, Hi] (weights_proj of the block input), cos/sin [N, rd], keys
        [N, E, Di] (decode: per sequence) or [E, Di] (prefill: one sequence's keys for all its queries)
        -> fp32 scores [N, E]."""
        N = q_res.shape[0]
        q = self.q_b_proj(q_res).view(N, self.n_heads, self.dim)
        q = apply_rope(q, cos, sin).float()
        if keys.dim() == 2:
            s = torch.matmul(q.view(N * self.n_heads, self.dim), keys.float().t()).view(N, self.n_heads, -1)
        else:
            s = torch.bmm(q, keys.float().transpose(1, 2))
        s = F.relu(s) * self.dim ** -0.5  # [N, Hi, E]
        w = head_w.float() * self.n_heads ** -0.5
        return (s * w.unsqueeze(-1)).sum(dim=1)

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores, visible [N, E] -> (indices [N, k], valid [N, k]), k = min(topk, E). Picks of invisible
        entries (a query with fewer than k visible ones) come back invalid, as in the reference."""
        k = min(self.topk, scores.shape[1])
        idx = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
        return idx, visible.gather(1, idx)

    def select_decode(self, scores: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode and verify, one query per row: row b holds n[b] real entries, then padding. -> (indices
        [B, k], valid [B, k]), k = min(topk, max n). ReLU makes exact-zero scores common, so ties are real;
        torch.topk breaks them by the row's length, and the reference ranks each query's row of exactly
        n[b] entries. So rows are ranked in groups of equal n, over their first n columns, never over the
        padding."""
        B, E = scores.shape
        k = min(self.topk, E)
        idx = torch.zeros(B, k, dtype=torch.long)
        valid = torch.zeros(B, k, dtype=torch.bool)
        for length in n.unique().tolist():
            if length == 0:
                continue
            rows = (n == length).nonzero().flatten()
            kk = min(self.topk, length)
            idx[rows, :kk] = scores[rows, :length].topk(kk, dim=-1).indices
            valid[rows, :kk] = True
        return idx, valid


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention layer; HF parameter names under `self_attn.`."""

    def __init__(self, cfg, layer_type: str, rates: dict, dtype: torch.dtype):
        super().__init__()
        self.layer_type = layer_type
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.groups = cfg.o_groups
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        hd = self.n_heads * self.head_dim
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, self.eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, hd, dtype)
        self.kv_proj = Linear(cfg.hidden_size, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.o_a_proj = Linear(hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype)
        self.sinks = _param(self.n_heads, dtype=torch.float32)
        self.compressor = None
        if layer_type != "sliding_attention":
            rate = rates[layer_type]
            if layer_type == "compressed_sparse_attention":
                self.compressor = Compressor(cfg.hidden_size, self.head_dim, rate, True, self.eps, dtype)
                self.compressor.indexer = Indexer(cfg, rate, dtype)
            else:
                self.compressor = HCACompressor(cfg.hidden_size, self.head_dim, rate, self.eps, dtype)
        self.ring: EntryPool | None = None  # SWA ring in the state pool: ring_len rows per sequence slot
        self.attend = get_op("v4_decode_attention")  # TileLang kernel on CUDA, C++ kernel on the CPU
        self.input_weight: torch.Tensor | None = None  # fuse_input_projections() after loading
        self.input_splits: list[int] = []

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None)

    def input_projections(self) -> list[Linear]:
        """The projections of the block input x: q_a, kv, then the compressor's kv and gate, then the
        indexer's kv, gate and head weights (those the layer type has)."""
        mods = [self.q_a_proj, self.kv_proj]
        if self.compressor is not None:
            mods += [self.compressor.kv_proj, self.compressor.gate_proj]
        if self.indexer is not None:
            mods += [self.indexer.kv_proj, self.indexer.gate_proj, self.indexer.scorer.weights_proj]
        return mods

    def fuse_input_projections(self) -> None:
        """Once the weights are loaded: one [sum of outputs, H] weight for all input_projections(), each
        module's weight becoming a view of its rows (no second copy). One GEMM per layer instead of up to
        seven, most of them narrow (128 or 16 outputs), which the CPU GEMM runs at half its rate at decode
        batch sizes."""
        mods = self.input_projections()
        self.input_weight = torch.cat([m.weight.data for m in mods])
        self.input_splits = [m.weight.shape[0] for m in mods]
        for m, view in zip(mods, self.input_weight.split(self.input_splits)):
            m.weight.data = view

    def project_input(self, x: torch.Tensor) -> tuple:
        """x [T, H] -> (q_a [T, q_lora], kv [T, D], comp): comp is () for sliding layers, else ((kv, raw gate)
        of the compressor, (kv, raw gate, head weights) of the indexer or None)."""
        if self.input_weight is None:
            raise RuntimeError("V4Attention.fuse_input_projections() must run after the weights are loaded")
        out = linear(x, self.input_weight).split(self.input_splits, dim=-1)
        if self.compressor is None:
            return out[0], out[1], ()
        return out[0], out[1], (out[2:4], out[4:7] if self.indexer is not None else None)

    def forward(self, x, positions, cos, sin, meta, replay_start: int | None = None) -> torch.Tensor:
        """x [T, H] (normed block input), cos/sin [T, rd] of this layer's rope type -> [T, H]."""
        T = x.shape[0]
        q_a, kv, comp = self.project_input(x)
        q_res = self.q_a_norm(q_a)
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(T, self.n_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.kv_norm(kv), cos, sin)
        if meta.is_prefill:
            out = torch.cat([self._prefill_seq(i, q, kv, q_res, cos, sin, comp, meta, replay_start)
                             for i in range(meta.num_seqs)])
        else:
            if meta.max_query_len > self.ring.per_block - self.window:
                raise ValueError(f"a verify step of {meta.max_query_len} tokens could not be rolled back: the "
                                 "model's max_backtracking must be at least that before cache_spec()")
            out = self._decode(q, kv, q_res, cos, sin, comp, meta)
        out = apply_rope(out, cos, sin, inverse=True)  # K=V carried rope into V: rotate it back
        return self._output(out)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: [T, Hq, D] -> per group [T, Hq*D/G] @ o_a[g] -> [T, G*R] -> o_b."""
        T = out.shape[0]
        grouped = out.reshape(T, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [G, R, in]
        mixed = torch.cat([linear(grouped[:, g], w[g]) for g in range(self.groups)], dim=-1)  # [T, G*R]
        return self.o_b_proj(mixed)

    # ---- prefill: one sequence at a time, dense tiles over its keys --------------------------------------

    def _prefill_seq(self, i, q, kv, q_res, cos, sin, comp, meta, replay_start):
        a, b = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        S, ctx = b - a, int(meta.context_lens[i])
        p0, slot, table = ctx - S, int(meta.state_slots[i]), meta.block_tables[i]
        pos = meta.positions[a:b]
        entries = visible = None
        if self.compressor is not None:
            entries, visible = self._prefill_compressed(a, b, p0, ctx, slot, table, pos, q_res, cos, sin, comp,
                                                        replay_start is None)
        lo, L = max(0, p0 - self.window + 1, replay_start or 0), self.ring.per_block
        # ring_len = window + mb rows, window - 1 of them read before p0: rolled-back drafts never
        # clobber those (write_ring); this chunk's own keys come from kv as the ring would return them
        keys = torch.cat([self.ring.read(slot * L + torch.arange(lo, p0) % L), self.ring.roundtrip(kv[a:b])])
        out = self._attend_tiles(q[a:b], pos, keys, lo, entries, visible)
        keep, rows = ring_rows(L, p0, b - a)
        self.ring.write(slot * L + rows, kv[a + keep:b])
        return out

    def _prefill_compressed(self, a, b, p0, ctx, slot, table, pos, q_res, cos, sin, comp, emit):
        """Write the windows this chunk closes, then return all of the sequence's entries [n, D] and which
        of them each query sees [S, n] (HCA: causal; CSA: the indexer's top-k)."""
        (ckv, cgate), idx_proj = comp
        self.compressor.prefill_update(ckv[a:b], cgate[a:b], p0, slot, table, emit)
        if self.indexer is not None:  # before its first window too: later windows pool these tokens
            ikv, igate, head_w = idx_proj
            self.indexer.prefill_update(ikv[a:b], igate[a:b], p0, slot, table, emit)
        n = ctx // self.compressor.rate
        if n == 0:
            return None, None
        w = torch.arange(n)
        entries = self.compressor.pool.read(self.compressor.pool.rows(table[None], w[None])[0])
        n_seen = (pos + 1) // self.compressor.rate
        if self.indexer is None:
            return entries, w[None, :] < n_seen[:, None]
        keys = self.indexer.pool.read(self.indexer.pool.rows(table[None], w[None])[0])
        return entries, self._indexer_chosen(a, head_w, q_res, cos, sin, keys, n_seen)

    def _indexer_chosen(self, a, head_w, q_res, cos, sin, keys, n_seen) -> torch.Tensor:
        """Which of the n entries (indexer keys [n, Di]) each of the queries a.. keeps -> [S, n]. Query j
        ranks its n_seen[j] visible entries as the reference's prefill does."""
        S, n = len(n_seen), keys.shape[0]
        chosen = torch.zeros(S, n, dtype=torch.bool)
        for c0 in range(0, S, PREFILL_QUERY_CHUNK):  # tiles bound the [C, Hi, n] score tensor
            c1 = min(c0 + PREFILL_QUERY_CHUNK, S)
            rows = slice(a + c0, a + c1)
            scores = self.indexer.scores(q_res[rows], head_w[rows], cos[rows], sin[rows], keys)
            idx, valid = self.indexer.select(scores, torch.arange(n)[None, :] < n_seen[c0:c1, None])
            chosen[c0:c1] = torch.zeros(c1 - c0, n, dtype=torch.bool).scatter_(1, idx, valid)
        return chosen

    def _attend_tiles(self, q, pos, keys, lo, entries, visible) -> torch.Tensor:
        """q [S, H, D] at positions pos; keys [K, D] hold positions lo..; entries [n, D] seen per `visible`
        [S, n]. Query t sees keys at positions (t - window, t]. -> [S, H, D]."""
        outs = []
        for c0 in range(0, q.shape[0], PREFILL_QUERY_CHUNK):
            c1 = min(c0 + PREFILL_QUERY_CHUNK, q.shape[0])
            t = pos[c0:c1]
            k0 = max(int(t[0]) - self.window + 1 - lo, 0)
            k1 = int(t[-1]) - lo + 1
            kpos = torch.arange(lo + k0, lo + k1)
            sw_mask = (kpos[None, :] <= t[:, None]) & (kpos[None, :] > t[:, None] - self.window)
            ks, masks = keys[k0:k1], [sw_mask]
            if entries is not None:
                ks = torch.cat([ks, entries])
                masks.append(visible[c0:c1])
            mask = torch.cat(masks, dim=1)  # [C, K]
            outs.append(self._softmax_attend(q[c0:c1].reshape(1, -1, q.shape[-1]), ks[None],
                                             mask.repeat_interleave(self.n_heads, dim=0)[None])[0])
        return torch.cat(outs).view(q.shape)

    def _softmax_attend(self, q, keys, mask) -> torch.Tensor:
        """q [B, M, D] (M = queries x heads, sharing one key set), keys [B, K, D] (K = V), mask [B, M, K]
        -> [B, M, D]. Every head reads the same single KV head, so this is one batched GEMM per sequence.
        The per-head sink joins the softmax and is dropped after it. Math in fp32 (bf16 matmuls are slow
        on these CPUs; for fp32 models this is the reference's arithmetic exactly)."""
        keys = keys.float()
        scores = torch.bmm(q.float(), keys.transpose(1, 2)) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        rows = q.shape[1] // self.n_heads
        sinks = self.sinks.repeat(rows).view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.bmm(probs, keys).to(q.dtype)

    # ---- decode and verify: one row per query token, batched ----------------------------------------------

    def _decode(self, q, kv, q_res, cos, sin, comp, meta) -> torch.Tensor:
        """q [N, H, D]: sequence r's 1 + l_r query rows at consecutive positions p0..p0 + l_r (l_r < mb; 0
        without speculation), each row a query with its own position and its sequence's slot and table."""
        pos = meta.positions
        slots = meta.state_slots.repeat_interleave(meta.query_lens)
        tables = meta.block_tables.repeat_interleave(meta.query_lens, dim=0)
        L = self.ring.per_block
        # Every row's kv goes in before any is read. Position p' of the step lands on the row of p' - L
        # <= p0 + l - window - mb < p0 - window, older than any query of the step sees; the window's other
        # rows outlive any rollback (write_ring).
        self.ring.write(slots * L + pos % L, kv)
        # each query's window, newest first: positions pos, pos - 1, ... (the first min(pos + 1, window)
        # are real); the step's later tokens sit on rows of p' - L, never among these
        recent = pos[:, None] - torch.arange(self.window)[None, :]
        window = self.ring.read(slots[:, None] * L + recent % L)  # [N, W, D], as whole-row index_selects
        entries = seen = None
        if self.compressor is not None:
            entries, seen = self._decode_compressed(pos, slots, tables, q_res, cos, sin, comp)
        if entries is None:
            entries, seen = window[:, :0], torch.zeros(len(pos), 0, dtype=torch.bool)
        return self.attend(q, window, (pos + 1).clamp(max=self.window), entries, seen, self.sinks, self.scale)

    def _decode_compressed(self, pos, slots, tables, q_res, cos, sin, comp):
        (ckv, cgate), idx_proj = comp
        rate = self.compressor.rate
        self.compressor.decode_update(ckv, cgate, pos, slots, tables)
        n = (pos + 1) // rate
        E = int(n.max())
        if self.indexer is not None:
            ikv, igate, head_w = idx_proj
            self.indexer.decode_update(ikv, igate, pos, slots, tables)
        if E == 0:
            return None, None
        w = torch.arange(E)[None, :].expand(len(pos), E)
        seen = w < n[:, None]
        if self.indexer is not None:
            keys = self.indexer.pool.read(self.indexer.pool.rows(tables, w))
            scores = self.indexer.scores(q_res, head_w, cos, sin, keys)
            w, seen = self.indexer.select_decode(scores, n)
        return self.compressor.pool.read(self.compressor.pool.rows(tables, w)), seen
