"""TileLang kernels built for the C target (fp32, serial) against their torch references."""
import pytest
import torch

from test_tilelang_cases import (attention_case, kv_load_case, kv_store_case, mask_case, sampling_case,
                                 verify_case)
from tilelang_ops import kv_load, kv_store, sampling, token_mask, v4_decode_attention, verify_len


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kv_store_c_bit_exact(fmt):
    x, slots, packed, scales = kv_store_case(fmt)
    p1, s1, p2, s2 = packed.clone(), scales.clone(), packed.clone(), scales.clone()
    kv_store.kv_store_ref(x, slots, p1, s1, fmt, 0.37)
    kv_store.kv_store(x, slots, p2, s2, fmt, 0.37)
    assert torch.equal(p1, p2) and torch.equal(s1, s2)
    # scale edge cases: all-zero group, tiny and huge magnitudes
    x2 = x.clone()
    x2[0, :32] = 0
    x2[1] *= 1e-30
    x2[2] *= 1e25
    kv_store.kv_store_ref(x2, slots, p1, s1, fmt)
    kv_store.kv_store(x2, slots, p2, s2, fmt)
    assert torch.equal(p1, p2) and torch.equal(s1, s2)
    kv_store.kv_store(x[:0], slots[:0], p2, s2, fmt)         # empty batch: nothing launched or written
    assert torch.equal(p1, p2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kv_load_c_bit_exact(fmt):
    q, s, table, idx = kv_load_case(fmt)
    s[0, 0] = 0                                              # smallest scale byte decodes too
    a, va = kv_load.kv_load_ref(q, s, table, idx, fmt, 0.5)
    b, vb = kv_load.kv_load(q, s, table, idx, fmt, 0.5)
    assert torch.equal(a, b) and torch.equal(va, vb)
    e, _ = kv_load.kv_load(q, s, table[:0], idx[:0], fmt)
    assert e.shape == (0, idx.shape[1], 64)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_attention_c(splits):
    """One tile holds the ring and the compressed entries (W + K < BLOCK_N); split-K over 1-3 splits, some
    of them empty, merged with the sink by the combine kernel."""
    case = attention_case()
    a = v4_decode_attention.v4_decode_attention_ref(*case)
    b = v4_decode_attention.v4_decode_attention(*case, splits=splits)
    assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)
    assert not b[-1].any()
    q, ring, ring_len, comp, valid, sinks, sc = case                  # no compressed entries yet
    a = v4_decode_attention.v4_decode_attention_ref(q, ring, ring_len, comp[:, :0], valid[:, :0], sinks, sc)
    b = v4_decode_attention.v4_decode_attention(q, ring, ring_len, comp[:, :0], valid[:, :0], sinks, sc,
                                                splits=splits)
    assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)


def v4_flash_attention_case(B=3, seed=6):
    """DeepSeek-V4-Flash decode: 64 heads of 512, window 128, top-k 512 compressed entries (10 tiles)."""
    q, ring, ring_len, comp, valid, sinks, sc = attention_case(B=B, H=64, D=512, W=128, K=512, seed=seed)
    ring_len[0] = 37                                         # a young sequence: part of its window is empty
    return q, ring, ring_len, comp, valid, sinks, sc


def test_attention_c_v4_flash_shapes():
    case = v4_flash_attention_case()
    a = v4_decode_attention.v4_decode_attention_ref(*case)
    for splits in (1, 4):
        b = v4_decode_attention.v4_decode_attention(*case, splits=splits)
        assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_attention_fp4_c(fmt):
    """Compressed entries dequantised inside the attention tile == kv_load then attention."""
    packed, scales, table, idx = kv_load_case(fmt)
    q, ring, ring_len, _, _, sinks, sc = attention_case(B=idx.shape[0], D=packed.shape[-1] * 2)
    a = v4_decode_attention.v4_decode_attention_fp4_ref(q, ring, ring_len, packed, scales, table, idx, sinks, sc,
                                                        fmt, 0.5)
    for splits in (1, 2):
        b = v4_decode_attention.v4_decode_attention_fp4(q, ring, ring_len, packed, scales, table, idx, sinks, sc,
                                                        fmt, 0.5, splits=splits)
        assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)


def test_verify_len_c():
    c = verify_case()
    for N in (0, 3, 11, 28, 50):
        assert torch.equal(verify_len.verify_len(c, N), verify_len.verify_len_ref(c, N))


def test_sampling_c():
    case = sampling_case()
    assert torch.equal(sampling.sample(*case), sampling.sample_ref(*case))
    case2 = list(case)
    case2[0] = case[0] + torch.randn_like(case[0])          # fresh logits, same compiled kernel
    case2[6] = case[6] + 1
    assert torch.equal(sampling.sample(*case2), sampling.sample_ref(*case2))


def test_token_mask_c():
    logits, mask = mask_case()
    a = token_mask.apply_token_mask_ref(logits.clone(), mask)
    b = logits.clone()
    assert token_mask.apply_token_mask(b, mask) is b
    assert torch.equal(a, b)


def test_kernel_boundary_rejects_unsupported():
    logits, mask = mask_case()
    with pytest.raises(ValueError, match="fp32 only"):
        token_mask.apply_token_mask(logits.bfloat16(), mask)
    with pytest.raises(ValueError, match="contiguous"):
        token_mask.apply_token_mask(logits.t().contiguous().t(), mask)
    q, ring, ring_len, comp, valid, sinks, sc = attention_case()
    with pytest.raises(ValueError, match="share dtype"):
        v4_decode_attention.v4_decode_attention(q, ring.bfloat16(), ring_len, comp, valid, sinks, sc)
    with pytest.raises(ValueError, match="float32"):
        sampling.sample(sampling_case()[0].bfloat16(), *sampling_case()[1:])
