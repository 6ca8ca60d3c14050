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
              dtype) or FP4 (NVFP4 main KV, MXFP4 indexer keys): quantised on write, dequantised on read.
  state pool  per sequence: the SWA ring (position p at row p % ring_len) and the compression accumulators
              (tokens of the unfinished window: kv and raw gate; for CSA the previous window's Ca half).
Nothing reads a ring row or an accumulator row this sequence has not written in its current life (every
read is bounded by positions), so a reused state slot needs no reset.
"""
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers import fp4
from deepinfer.layers.hyper_connection import unweighted_rms_norm

from deepinfer.layers.linear import linear  # bf16 weights -> C++ AVX2 GEMM (torch's bf16 matmul is ~8 GFLOP/s here)

PREFILL_QUERY_CHUNK = 256  # queries per dense attention tile in prefill: bounds the [H, C, K] score tile


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepseekV4RMSNorm: statistic and fp32 weight applied in fp32, one cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2*cos.shape[-1] channels of x [..., D]; cos/sin [..., rd/2]
    broadcast against x[..., :rd/2]. fp32 math, result in x's dtype (as the reference)."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rope = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([nope, rope], dim=-1)


class Rope:
    """One rope type (V4 has `main` for sliding layers and `compress` for CSA/HCA layers and compressors)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        self.inv_freq = inv_freq.float()
        self.scaling = attention_scaling

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, rd/2] in dtype (the reference casts them to the activation dtype)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


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
    """One layer's compressed entries in the paged pool. data [num_blocks, per_block, D] in the model dtype
    ('auto'), or packed uint8 [num_blocks, per_block, D/2] plus scale [num_blocks, per_block, D/16 | D/32]
    ('nvfp4' | 'mxfp4')."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, fmt: str, dtype: torch.dtype):
        self.data, self.scale, self.fmt, self.dtype = data, scale, fmt, dtype
        self.per_block = data.shape[1]

    def rows(self, block_tables: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """block_tables [B, M], entry indices w [B, E] -> flat pool rows [B, E] (padding maps to row 0)."""
        col = (w // self.per_block).clamp(max=block_tables.shape[1] - 1)
        block = block_tables.gather(1, col).clamp(min=0)
        return block * self.per_block + w % self.per_block

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """rows [N], values [N, D]."""
        flat = self.data.view(-1, self.data.shape[-1])
        if self.fmt == "auto":
            flat[rows] = values.to(flat.dtype)
            return
        packed, scales = fp4.quantize_nvfp4(values) if self.fmt == "nvfp4" else fp4.quantize_mxfp4(values)
        flat[rows] = packed
        self.scale.view(-1, self.scale.shape[-1])[rows] = scales

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [...] -> entries [..., D] in the model dtype."""
        flat = self.data.view(-1, self.data.shape[-1])
        if self.fmt == "auto":
            return flat[rows]
        scales = self.scale.view(-1, self.scale.shape[-1])[rows]
        if self.fmt == "nvfp4":
            return fp4.dequantize_nvfp4(flat[rows], scales, dtype=self.dtype)
        return fp4.dequantize_mxfp4(flat[rows], scales, dtype=self.dtype)


class Compressor(nn.Module):
    """Softmax-gated pooling of source tokens into compressed entries (DeepseekV4HCACompressor /
    DeepseekV4CSACompressor / the indexer's own compressor).

    HCA (overlap=False): entry w = sum over window w's `rate` tokens of softmax(gate + bias) * kv.
    CSA (overlap=True): kv/gate are 2*dim wide: Ca = [:dim], Cb = [dim:]. Entry w pools window w-1's Ca and
    window w's Cb (2*rate slots, stride rate); window 0 has no Ca part (zero kv, -inf gate).
    Then RMSNorm and RoPE at the window's first source position w * rate.

    State (per sequence): buf_kv/buf_gate [rate, width] hold the unfinished window's tokens (row = position
    % rate, raw gate); CSA adds ov_kv/ov_gate [rate, dim], the Ca half of the last finished window.
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
        self.buf_kv = self.buf_gate = self.ov_kv = self.ov_gate = None

    def bind(self, pool: EntryPool, buf_kv, buf_gate, ov_kv=None, ov_gate=None) -> None:
        self.pool, self.buf_kv, self.buf_gate, self.ov_kv, self.ov_gate = pool, buf_kv, buf_gate, ov_kv, ov_gate

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> kv, raw gate [T, width] (model dtype)."""
        return self.kv_proj(x), self.gate_proj(x)

    def pool_windows(self, kv, gate_raw, prior_kv, prior_gate_raw, has_prior, window_ids) -> torch.Tensor:
        """kv, gate_raw [n, rate, width]; prior_* [n, rate, dim] (CSA: Ca half of window w-1, raw gate);
        has_prior [n] bool; window_ids [n] -> entries [n, dim] (normed, roped)."""
        gate = gate_raw + self.position_bias  # fp32, as the reference
        if self.overlap:
            d = self.dim
            prior_gate = (prior_gate_raw + self.position_bias[:, :d]).masked_fill(~has_prior[:, None, None],
                                                                                  float("-inf"))
            prior_kv = prior_kv.to(kv.dtype).masked_fill(~has_prior[:, None, None], 0.0)
            kv = torch.cat([prior_kv, kv[..., d:]], dim=1)
            gate = torch.cat([prior_gate, gate[..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        entries = self.kv_norm(pooled)
        cos, sin = self.rope(window_ids * self.rate, entries.dtype)
        return apply_rope(entries, cos, sin)

    def prefill_update(self, kv, gate, p0: int, slot: int, block_table: torch.Tensor, emit: bool = True) -> None:
        """One sequence's new tokens at positions p0.. (kv, gate [S, width]): emit every window they close
        into the paged pool (unless `emit` is False: replay keeps the exact entries already there), then
        keep the unfinished tail and the last Ca half in the state slot."""
        r = self.rate
        held = p0 % r
        if held:
            old_kv, old_gate = self.buf_kv[slot, :held], self.buf_gate[slot, :held]
            if not emit:  # replay: the unfinished window started before the replayed span; never read it
                old_kv, old_gate = torch.zeros_like(old_kv), torch.zeros_like(old_gate)
            kv, gate = torch.cat([old_kv, kv]), torch.cat([old_gate, gate])
        n = kv.shape[0] // r
        if n:
            w0 = (p0 - held) // r
            chunk_kv, chunk_gate = kv[: n * r].view(n, r, -1), gate[: n * r].view(n, r, -1)
            if emit:
                self._emit(chunk_kv, chunk_gate, w0, slot, block_table)
            if self.overlap:
                self.ov_kv[slot] = chunk_kv[-1, :, : self.dim]
                self.ov_gate[slot] = chunk_gate[-1, :, : self.dim]
        tail = kv.shape[0] - n * r
        if tail:
            self.buf_kv[slot, :tail] = kv[n * r:]
            self.buf_gate[slot, :tail] = gate[n * r:]

    def _emit(self, chunk_kv, chunk_gate, w0: int, slot: int, block_table: torch.Tensor) -> None:
        n = chunk_kv.shape[0]
        window_ids = torch.arange(w0, w0 + n)
        prior_kv = prior_gate = has_prior = None
        if self.overlap:
            d = self.dim
            first_kv = self.ov_kv[slot].unsqueeze(0) if w0 > 0 else torch.zeros_like(chunk_kv[:1, :, :d])
            first_gate = self.ov_gate[slot].unsqueeze(0) if w0 > 0 else torch.zeros_like(chunk_gate[:1, :, :d])
            prior_kv = torch.cat([first_kv, chunk_kv[:-1, :, :d]])
            prior_gate = torch.cat([first_gate, chunk_gate[:-1, :, :d]])
            has_prior = window_ids > 0
        entries = self.pool_windows(chunk_kv, chunk_gate, prior_kv, prior_gate, has_prior, window_ids)
        self.pool.write(self.pool.rows(block_table[None], window_ids[None])[0], entries)

    def decode_update(self, kv, gate, positions, slots, block_tables) -> None:
        """One token per sequence (kv, gate [B, width], positions/slots [B]): buffer it; sequences whose
        token closes a window emit that entry."""
        r = self.rate
        col = positions % r
        self.buf_kv[slots, col] = kv
        self.buf_gate[slots, col] = gate
        done = (col == r - 1).nonzero().flatten()
        if done.numel() == 0:
            return
        s = slots[done]
        window_ids = positions[done] // r
        chunk_kv, chunk_gate = self.buf_kv[s], self.buf_gate[s]
        prior_kv = prior_gate = has_prior = None
        if self.overlap:
            prior_kv, prior_gate, has_prior = self.ov_kv[s], self.ov_gate[s], window_ids > 0
            self.ov_kv[s] = chunk_kv[:, :, : self.dim]
            self.ov_gate[s] = chunk_gate[:, :, : self.dim]
        entries = self.pool_windows(chunk_kv, chunk_gate, prior_kv, prior_gate, has_prior, window_ids)
        self.pool.write(self.pool.rows(block_tables[done], window_ids[:, None])[:, 0], entries)


class HCACompressor(Compressor):
    """HCA compressor (no overlap, rate m' = 128) whose unfinished window is kept as an online-softmax
    accumulator instead of its raw tokens: per channel the running max of gate + bias, the running sum of
    exp(gate + bias - max) and of kv * exp(...), all fp32, state acc [3, D] (1.5 KB at D = 128 instead of
    2 * m' * D model-dtype values: 64 KB in bf16). Windows that a single prefill covers are pooled exactly
    as the reference; a window spanning steps is pooled online, which equals the reference's softmax up to
    fp32 rounding."""

    def __init__(self, hidden_size: int, dim: int, rate: int, eps: float, dtype: torch.dtype):
        super().__init__(hidden_size, dim, rate, False, eps, dtype)
        self.acc: torch.Tensor | None = None  # state pool [slots, 3, D] fp32: max, denominator, numerator

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
        r, S = self.rate, kv.shape[0]
        held = p0 % r
        logit = gate + self.position_bias[(torch.arange(p0, p0 + S) % r)]
        head = min(S, r - held) if held else 0
        if head:  # the window this sequence left unfinished
            acc = self.acc[slot] if emit else self.empty()  # replay: it began before the span; unused
            acc = self.merge(acc, kv[:head], logit[:head])
            if held + head == r:
                if emit:
                    self._write(self.finish(acc[None], torch.tensor([p0 // r]), kv.dtype), p0 // r, block_table)
            else:
                self.acc[slot] = acc
                return
        n = (S - head) // r
        if n:  # whole windows: pooled exactly as the reference
            w0 = (p0 + head) // r
            body = slice(head, head + n * r)
            chunk_kv, chunk_gate = kv[body].view(n, r, -1), gate[body].view(n, r, -1)
            if emit:
                ids = torch.arange(w0, w0 + n)
                self._write(self.pool_windows(chunk_kv, chunk_gate, None, None, None, ids), w0, block_table)
        tail = slice(head + n * r, S)
        self.acc[slot] = self.merge(self.empty(), kv[tail], logit[tail])

    def _write(self, entries: torch.Tensor, w0: int, block_table: torch.Tensor) -> None:
        ids = torch.arange(w0, w0 + entries.shape[0])
        self.pool.write(self.pool.rows(block_table[None], ids[None])[0], entries)

    def decode_update(self, kv, gate, positions, slots, block_tables) -> None:
        r = self.rate
        col = positions % r
        acc = self.acc[slots]
        acc = torch.where((col == 0)[:, None, None], self.empty(len(slots)), acc)  # a new window starts
        acc = self.merge(acc, kv[:, None], (gate + self.position_bias[col])[:, None])
        self.acc[slots] = acc
        done = (col == r - 1).nonzero().flatten()
        if done.numel():
            window_ids = positions[done] // r
            entries = self.finish(acc[done], window_ids, kv.dtype)
            self.pool.write(self.pool.rows(block_tables[done], window_ids[:, None])[:, 0], entries)


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

    def scores(self, q_res, x, cos, sin, keys) -> torch.Tensor:
        """q_res [N, q_lora], x [N, H], cos/sin [N, rd/2], keys [N, E, Di] (decode: per sequence) or [E, Di]
        (prefill: one sequence's keys for all its queries) -> fp32 scores [N, E]."""
        N = q_res.shape[0]
        q = self.q_b_proj(q_res).view(N, self.n_heads, self.dim)
        q = apply_rope(q, cos[:, None], sin[:, None]).float()
        if keys.dim() == 2:
            s = torch.matmul(q.view(N * self.n_heads, self.dim), keys.float().t()).view(N, self.n_heads, -1)
        else:
            s = torch.bmm(q, keys.float().transpose(1, 2))
        s = F.relu(s) * self.dim ** -0.5  # [N, Hi, E]
        w = self.scorer.weights_proj(x).float() * self.n_heads ** -0.5
        return (s * w.unsqueeze(-1)).sum(dim=1)

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores, visible [N, E] -> (indices [N, k], valid [N, k]), k = min(topk, E). Picks of invisible
        entries (a query with fewer than k visible ones) come back invalid, as in the reference."""
        k = min(self.topk, scores.shape[1])
        idx = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
        return idx, visible.gather(1, idx)

    def select_decode(self, scores: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: row b holds n[b] real entries, then padding. -> (indices [B, k], valid [B, k]),
        k = min(topk, max n). ReLU makes exact-zero scores common, so ties are real; torch.topk breaks them
        by the row's length, and the reference ranks each sequence's row of exactly n[b] entries. So rows
        are ranked in groups of equal n, over their first n columns, never over the padding."""
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
        self.ring: torch.Tensor | None = None  # state pool [slots, ring_len, D]

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None)

    def forward(self, x, positions, cos, sin, meta, replay_start: int | None = None) -> torch.Tensor:
        """x [T, H] (normed block input), cos/sin [T, rd/2] of this layer's rope type -> [T, H]."""
        T = x.shape[0]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(T, self.n_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos[:, None], sin[:, None])
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        comp = ()
        if self.compressor is not None:
            comp = (self.compressor.project(x), self.indexer.project(x) if self.indexer else None)
        if meta.is_prefill:
            out = torch.cat([self._prefill_seq(i, q, kv, x, q_res, cos, sin, comp, meta, replay_start)
                             for i in range(meta.num_seqs)])
        else:
            out = self._decode(q, kv, x, q_res, cos, sin, comp, meta)
        out = apply_rope(out, cos[:, None], -sin[:, None])  # K=V carried rope into V: rotate it back
        return self._output(out)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: [T, Hq, D] -> per group [T, Hq*D/G] @ o_a[g] -> [T, G*R] -> o_b."""
        T = out.shape[0]
        grouped = out.reshape(T, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [G, R, in]
        mixed = torch.cat([linear(grouped[:, g], w[g]) for g in range(self.groups)], dim=-1)  # [T, G*R]
        return self.o_b_proj(mixed)

    # ---- prefill: one sequence at a time, dense tiles over its keys --------------------------------------

    def _prefill_seq(self, i, q, kv, x, q_res, cos, sin, comp, meta, replay_start):
        a, b = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        S, ctx = b - a, int(meta.context_lens[i])
        p0, slot, table = ctx - S, int(meta.state_slots[i]), meta.block_tables[i]
        pos = meta.positions[a:b]
        entries = visible = None
        if self.compressor is not None:
            entries, visible = self._prefill_compressed(a, b, p0, ctx, slot, table, pos, x, q_res, cos, sin,
                                                        comp, replay_start is None)
        lo = max(0, p0 - self.window + 1, replay_start or 0)
        ring_len = self.ring.shape[1]
        prev_pos = torch.arange(lo, p0)
        keys = torch.cat([self.ring[slot, prev_pos % ring_len], kv[a:b]])
        out = self._attend_tiles(q[a:b], pos, keys, lo, entries, visible)
        keep = slice(max(0, S - ring_len), S)  # only the last ring_len tokens can be read again
        self.ring[slot, pos[keep] % ring_len] = kv[a:b][keep]
        return out

    def _prefill_compressed(self, a, b, p0, ctx, slot, table, pos, x, q_res, cos, sin, comp, emit):
        """Write the windows this chunk closes, then return all of the sequence's entries [n, D] and which
        of them each query sees [S, n] (HCA: causal; CSA: the indexer's top-k)."""
        (ckv, cgate), idx_proj = comp
        self.compressor.prefill_update(ckv[a:b], cgate[a:b], p0, slot, table, emit)
        n = ctx // self.compressor.rate
        if n == 0:
            return None, None
        w = torch.arange(n)
        entries = self.compressor.pool.read(self.compressor.pool.rows(table[None], w[None])[0])
        visible = w[None, :] < ((pos + 1) // self.compressor.rate)[:, None]
        if self.indexer is not None:
            ikv, igate = idx_proj
            self.indexer.prefill_update(ikv[a:b], igate[a:b], p0, slot, table, emit)
            keys = self.indexer.pool.read(self.indexer.pool.rows(table[None], w[None])[0])
            chosen = torch.zeros_like(visible)
            for c0 in range(0, b - a, PREFILL_QUERY_CHUNK):  # tiles bound the [C, Hi, n] score tensor
                c1 = min(c0 + PREFILL_QUERY_CHUNK, b - a)
                rows = slice(a + c0, a + c1)
                scores = self.indexer.scores(q_res[rows], x[rows], cos[rows], sin[rows], keys)
                idx, valid = self.indexer.select(scores, visible[c0:c1])
                chosen[c0:c1].scatter_(1, idx, valid)
            visible = chosen
        return entries, visible

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

    # ---- decode: one token per sequence, batched ---------------------------------------------------------

    def _decode(self, q, kv, x, q_res, cos, sin, comp, meta) -> torch.Tensor:
        pos, slots, tables = meta.positions, meta.state_slots, meta.block_tables
        ring_len = self.ring.shape[1]
        self.ring[slots, pos % ring_len] = kv
        keys = [self.ring[slots]]  # [B, L, D]
        row_pos = pos[:, None] - (pos[:, None] - torch.arange(ring_len)[None, :]) % ring_len
        masks = [row_pos > pos[:, None] - self.window]  # row_pos <= pos always; >= 0 follows from the window
        masks[0] &= row_pos >= 0
        if self.compressor is not None:
            entries, seen = self._decode_compressed(pos, slots, tables, x, q_res, cos, sin, comp)
            if entries is not None:
                keys.append(entries)
                masks.append(seen)
        mask = torch.cat(masks, dim=1)[:, None, :].expand(-1, self.n_heads, -1)
        return self._softmax_attend(q, torch.cat(keys, dim=1), mask)

    def _decode_compressed(self, pos, slots, tables, x, q_res, cos, sin, comp):
        (ckv, cgate), idx_proj = comp
        rate = self.compressor.rate
        self.compressor.decode_update(ckv, cgate, pos, slots, tables)
        n = (pos + 1) // rate
        E = int(n.max())
        if self.indexer is not None:
            self.indexer.decode_update(*idx_proj, pos, slots, tables)
        if E == 0:
            return None, None
        w = torch.arange(E)[None, :].expand(len(pos), E)
        seen = w < n[:, None]
        if self.indexer is not None:
            keys = self.indexer.pool.read(self.indexer.pool.rows(tables, w))
            scores = self.indexer.scores(q_res, x, cos, sin, keys)
            w, seen = self.indexer.select_decode(scores, n)
        return self.compressor.pool.read(self.compressor.pool.rows(tables, w)), seen
