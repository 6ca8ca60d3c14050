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


def test_attention_c():
    case = attention_case()
    a = v4_decode_attention.v4_decode_attention_ref(*case)
    b = v4_decode_attention.v4_decode_attention(*case)
    assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)
    assert not b[-1].any()


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
