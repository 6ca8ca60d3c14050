"""Paged attention over block tables (torch), used for both prefill (varlen) and decode."""
import torch
import torch.nn.functional as F

from deepinfer.layers import cpu_ops
from deepinfer.layers.attention_metadata import AttentionMetadata
from deepinfer.layers.gemm_plan import PLAN

Q_TILE = 256  # prefill queries per attention call


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache, v_cache [num_blocks, block_size, Hkv, D]; k, v [T, Hkv, D]; slot_mapping [T]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D] over each sequence's cached keys (causal) -> [T, H, D].

    Keys are gathered per sequence through its block table into [B, max_blocks * block_size]. Fresh prompts
    take one causal SDPA each; otherwise (chunks, verify rows) queries are padded to [B, max_query_len] and
    masked SDPA calls over query tiles cover the batch. Decode on CPU (one
    query per sequence) goes to the C++ kernel instead, which reads the cache in place: the gather, widening
    and padded SDPA cost more than the decode step's GEMMs at batches of 16-64."""
    if meta.max_query_len == 1 and q.device.type == "cpu" and q.dtype in cpu_ops.STREAM_DTYPES \
            and k_cache.dtype == q.dtype:
        return cpu_ops.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.block_tables,
                                              meta.context_lens, scale)
    # fp32 math unless torch's bf16 SDPA measured clearly faster here (AMX): on AVX2 CPUs it is several times slower
    # than converting first.
    dtype = PLAN.attention_dtype(q.dtype, q.shape[1], k_cache.shape[2], q.shape[2]) if q.device.type == "cpu" \
        else torch.float32
    block_tables = meta.block_tables.clamp(min=0)
    keys = k_cache[block_tables].flatten(1, 2).transpose(1, 2).to(dtype)   # [B, Hkv, L, D]
    values = v_cache[block_tables].flatten(1, 2).transpose(1, 2).to(dtype)
    if bool((meta.context_lens == meta.query_lens).all()):
        return _fresh_prefill(q, keys, values, meta, scale)
    q_idx, q_valid = _padded_query_index(meta)
    queries = q[q_idx].transpose(1, 2).to(dtype)                          # [B, H, Qmax, D]
    q_pos = (meta.context_lens - meta.query_lens)[:, None] + torch.arange(meta.max_query_len)
    # Query tiles, each against only the keys its queries may see: a long prompt's causal half is never
    # scored, and no [Qmax, L] score matrix is built at once.
    tiles = []
    for lo in range(0, meta.max_query_len, Q_TILE):
        pos = q_pos[:, lo:lo + Q_TILE]
        seen = min(keys.shape[2], int(pos.max()) + 1)
        mask = torch.arange(seen)[None, None, :] <= pos[:, :, None]      # [B, tile, seen]
        tiles.append(F.scaled_dot_product_attention(queries[:, :, lo:lo + Q_TILE], keys[:, :, :seen],
                                                    values[:, :, :seen], attn_mask=mask[:, None], scale=scale,
                                                    enable_gqa=queries.shape[1] != keys.shape[1]))
    out = torch.cat(tiles, dim=2)
    return out.transpose(1, 2)[q_valid].to(q.dtype)


def _fresh_prefill(q, keys, values, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Prompts with nothing cached before them: per sequence one causal SDPA over its own keys, which torch
    runs as a fused kernel skipping the masked half (half the time of an explicit mask at 4096 tokens).
    keys, values [B, Hkv, L, D] in the dtype attention runs in -> [T, H, D]."""
    qsl = meta.query_start_loc.tolist()
    out = []
    for i in range(meta.num_seqs):
        n = qsl[i + 1] - qsl[i]
        queries = q[qsl[i]:qsl[i + 1]].transpose(0, 1)[None].to(keys.dtype)  # [1, H, n, D]
        out.append(F.scaled_dot_product_attention(queries, keys[i:i + 1, :, :n], values[i:i + 1, :, :n],
                                                  is_causal=True, scale=scale,
                                                  enable_gqa=queries.shape[1] != keys.shape[1])[0].transpose(0, 1))
    return torch.cat(out).to(q.dtype)


def _padded_query_index(meta: AttentionMetadata):
    """[B, Qmax] row of each padded query slot (clamped) and [B, Qmax] whether it is real."""
    offsets = torch.arange(meta.max_query_len)
    q_valid = offsets[None, :] < meta.query_lens[:, None]
    q_idx = (meta.query_start_loc[:-1, None] + offsets[None, :]).clamp(max=meta.positions.shape[0] - 1)
    return q_idx, q_valid
