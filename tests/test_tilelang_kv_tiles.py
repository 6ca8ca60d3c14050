"""Tile-level kv_store / kv_load: bit-exact with the references at DeepSeek-V4 shapes on the C target
(tests/test_tilelang_cuda.py builds them for sm_90a and checks they lower to vector loads and stores)."""
import pytest
import torch

from deepinfer.formats.fp4 import quantize_mxfp4, quantize_nvfp4
from tilelang_ops.kv_load import kv_load, kv_load_ref
from tilelang_ops.kv_store import GROUP, kv_store, kv_store_ref

V4 = {"nvfp4": 512, "mxfp4": 128}   # main KV / indexer keys head dims
BE = 64                             # pool block_entries
TOPK = 512


def store_case(fmt, N, NB=4, seed=0):
    """x [N, D] with per-token magnitudes 2^-20..2^20, all-zero / tiny / huge / tie-valued groups, and
    a pool of random bytes (untouched slots must keep them); about a quarter of the tokens are padding."""
    D, G = V4[fmt], GROUP[fmt]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g) * torch.exp2(torch.randint(-20, 21, (N, 1), generator=g).float())
    x[0, :3 * G] = 0                                            # all-zero groups
    x[1] *= 1e-30                                               # scales underflow / go subnormal
    x[2] *= 1e25                                                # huge scales (nvfp4 clamps at 448)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0, 7.0, -5.0])
    x[3, :ties.numel()] = ties * 0.5                            # exact E2M1 midpoints once scaled
    x[4, ::2] = -x[4, 1::2]                                     # sign pairs within each byte
    slots = torch.randperm(NB * BE, generator=g)[:N]           # distinct: one writer per slot
    pad = torch.rand(N, generator=g) < 0.25
    pad[:5] = False                                             # the edge rows are stored
    slots[pad] = -1
    packed = torch.randint(0, 256, (NB, BE, D // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (NB, BE, D // G), dtype=torch.uint8, generator=g)
    return x, slots, packed, scales


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("N", [1, 37, 130])                  # 37, 130: not a multiple of a block's tile
def test_kv_store_tiles_bit_exact(fmt, N):
    x, slots, packed, scales = store_case(fmt, max(N, 5), seed=N)
    x, slots = x[:N], slots[:N]
    for ts in (1.0, 0.37):
        if fmt == "mxfp4" and ts != 1.0:
            continue
        p1, s1, p2, s2 = packed.clone(), scales.clone(), packed.clone(), scales.clone()
        kv_store_ref(x, slots, p1, s1, fmt, ts)
        kv_store(x, slots, p2, s2, fmt, ts)
        assert torch.equal(p1, p2) and torch.equal(s1, s2)
        assert N == 1 or not torch.equal(p2, packed)           # something was written


def test_kv_store_tiles_all_padding():
    x, slots, packed, scales = store_case("nvfp4", 20, seed=7)
    p, s = packed.clone(), scales.clone()
    kv_store(x, torch.full_like(slots, -1), p, s, "nvfp4")
    assert torch.equal(p, packed) and torch.equal(s, scales)


def load_case(fmt, B, K, NB=24, MB=10, seed=1):
    """A pool quantised from random rows (scale bytes include the extremes), block tables with unused
    (-1) tails, and top-k indices with ragged -1 padding (one query all padding, one full)."""
    D = V4[fmt]
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(NB, BE, D, generator=g) * torch.exp2(torch.randint(-8, 9, (NB, BE, 1), generator=g).float())
    q, s = quantize_nvfp4(src, 0.5) if fmt == "nvfp4" else quantize_mxfp4(src)
    s[0, 0, :2] = torch.tensor([0, 126 if fmt == "nvfp4" else 254], dtype=torch.uint8)
    table = torch.stack([torch.randperm(NB, generator=g)[:MB] for _ in range(B)])
    used = torch.randint(MB - 2, MB + 1, (B,), generator=g)     # >= TOPK entries in use
    table[torch.arange(MB).view(1, MB) >= used.view(B, 1)] = -1
    idx = torch.stack([torch.randperm(int(u) * BE, generator=g)[:K] for u in used])
    lens = torch.randint(0, K + 1, (B,), generator=g)
    lens[0], lens[-1] = K, 0
    idx[torch.arange(K).view(1, K) >= lens.view(B, 1)] = -1
    return q, s, table, idx


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("K", [TOPK, 37])                    # 37: not a multiple of a block's entries
def test_kv_load_tiles_bit_exact(fmt, K):
    q, s, table, idx = load_case(fmt, B=3, K=K, seed=K)
    a, va = kv_load_ref(q, s, table, idx, fmt, 0.5)
    b, vb = kv_load(q, s, table, idx, fmt, 0.5)
    assert torch.equal(a, b) and torch.equal(va, vb)
    assert not b[-1].any() and b[0].abs().sum() > 0            # padding is zeros, real entries are not
    assert torch.equal(torch.signbit(a), torch.signbit(b))     # same zeros, not just equal values


def test_kv_load_tiles_int32_inputs_and_random_bytes():
    """Any byte pattern decodes like the reference (both nibbles, every scale byte), int32 index tensors."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (4, BE, 64), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 255, (4, BE, 4), dtype=torch.uint8, generator=g)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    idx = torch.randint(-1, 2 * BE, (2, 40), dtype=torch.int32, generator=g)
    a, va = kv_load_ref(q, s, table, idx, "mxfp4")
    b, vb = kv_load(q, s, table, idx, "mxfp4")
    assert torch.equal(a, b) and torch.equal(va, vb)


def test_kv_tiles_c_target_is_fp32_only():
    """bf16 does not lower on the C target (no C type for it), so the wrappers refuse it up front."""
    x, slots, packed, scales = store_case("mxfp4", 8)
    with pytest.raises(ValueError, match="fp32 only"):
        kv_store(x.bfloat16(), slots, packed, scales, "mxfp4")
    q, s, table, idx = load_case("mxfp4", B=2, K=8)
    with pytest.raises(ValueError, match="fp32 only"):
        kv_load(q, s, table, idx, "mxfp4", dtype=torch.bfloat16)

