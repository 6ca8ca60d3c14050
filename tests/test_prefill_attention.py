"""Prefill attention through the block tables (deepinfer/layers/attention.py) in the dtype the GEMM plan picks:
fresh prompts (one causal SDPA each) and chunks over cached keys (padded query tiles), in fp32 and in bf16, against
a causal softmax per sequence in fp64."""
import pytest
import torch

from deepinfer.layers import attention
from deepinfer.layers.attention_metadata import AttentionMetadata

BLOCK, HEADS, KV_HEADS, D = 4, 4, 2, 32


def _batch(query_lens: list[int], context_lens: list[int], gen: torch.Generator):
    """Caches holding every sequence's keys and values (scattered blocks), q [T, H, D] of its last query_lens
    positions and the step's metadata, bf16."""
    per = [(c + BLOCK - 1) // BLOCK for c in context_lens]
    ids = torch.randperm(sum(per) + 3, generator=gen)
    tables = torch.full((len(per), max(per)), -1, dtype=torch.int64)
    for b, n in enumerate(per):
        tables[b, :n], ids = ids[:n], ids[n:]
    k_cache, v_cache = (torch.randn(sum(per) + 3, BLOCK, KV_HEADS, D, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(sum(query_lens), HEADS, D, generator=gen).bfloat16()
    starts = torch.tensor([0] + query_lens).cumsum(0)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)])
    meta = AttentionMetadata(is_prefill=True, positions=positions, slot_mapping=torch.zeros_like(positions),
                             query_start_loc=starts, context_lens=torch.tensor(context_lens), block_tables=tables,
                             state_slots=torch.arange(len(per)), block_size=BLOCK, max_query_len=max(query_lens),
                             max_context_len=max(context_lens))
    return q, k_cache, v_cache, meta


def _reference(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    out = []
    for b in range(meta.num_seqs):
        c = int(meta.context_lens[b])
        rows = meta.block_tables[b, :(c + BLOCK - 1) // BLOCK]
        keys, values = (cache[rows].flatten(0, 1)[:c].double().repeat_interleave(HEADS // KV_HEADS, 1)
                        for cache in (k_cache, v_cache))                   # [c, H, D]
        qs = q[meta.query_start_loc[b]:meta.query_start_loc[b + 1]].double()
        pos = meta.positions[meta.query_start_loc[b]:meta.query_start_loc[b + 1]]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        scores.masked_fill_(torch.arange(c)[None, None, :] > pos[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens, context_lens", [([5, 9], [5, 9]), ([5, 3, 1], [5, 11, 7])])
def test_prefill_attention_in_the_planned_dtype_matches_a_causal_softmax(monkeypatch, dtype, query_lens,
                                                                         context_lens):
    monkeypatch.setattr(attention.PLAN, "attention_dtype", lambda *shape: dtype)
    q, k_cache, v_cache, meta = _batch(query_lens, context_lens, torch.Generator().manual_seed(len(query_lens)))
    out = attention.paged_attention(q, k_cache, v_cache, meta, D ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = _reference(q, k_cache, v_cache, meta, D ** -0.5)
    # fp32 math: one bf16 rounding of the output; bf16 math also rounds the probabilities before the values
    tol = dict(rtol=2 ** -7, atol=2e-3) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
