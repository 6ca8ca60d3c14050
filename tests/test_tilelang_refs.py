"""Torch references of tilelang_ops against slow, obviously-correct loops; bad input; dispatch on CPU."""
import math

import numpy as np
import pytest
import torch

from deepinfer.formats.fp4 import dequantize_mxfp4, dequantize_nvfp4, quantize_mxfp4, quantize_nvfp4
from test_tilelang_cases import (attention_case, kv_load_case, kv_store_case, mask_case, sampling_case,
                                 verify_case)
from tilelang_ops import sampling
from tilelang_ops.dispatch import get_op
from tilelang_ops.kv_load import kv_load_ref
from tilelang_ops.kv_store import kv_store_ref
from tilelang_ops.sampling import sample_ref
from tilelang_ops.token_mask import apply_token_mask_ref
from tilelang_ops.v4_decode_attention import v4_decode_attention_ref
from tilelang_ops.verify_len import verify_len_ref


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kv_store_ref_matches_loop(fmt):
    x, slots, packed, scales = kv_store_case(fmt)
    p1, s1, p2, s2 = packed.clone(), scales.clone(), packed.clone(), scales.clone()
    kv_store_ref(x, slots, p1, s1, fmt, 0.5)
    BE = packed.shape[1]
    for n in range(x.shape[0]):
        if slots[n] < 0:
            continue
        q, s = quantize_nvfp4(x[n], 0.5) if fmt == "nvfp4" else quantize_mxfp4(x[n])
        p2[slots[n] // BE, slots[n] % BE], s2[slots[n] // BE, slots[n] % BE] = q, s
    assert torch.equal(p1, p2) and torch.equal(s1, s2)
    assert not torch.equal(p1, packed)                       # something was written
    kv_store_ref(x[:0], slots[:0], p1, s1, fmt)              # empty batch: no-op
    assert torch.equal(p1, p2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kv_load_ref_matches_loop(fmt):
    q, s, table, idx = kv_load_case(fmt)
    out, valid = kv_load_ref(q, s, table, idx, fmt, 0.5)
    B, K = idx.shape
    BE = q.shape[1]
    for b in range(B):
        for j in range(K):
            p = int(idx[b, j])
            if p < 0:
                assert not valid[b, j] and not out[b, j].any()
                continue
            blk, off = int(table[b, p // BE]), p % BE
            want = (dequantize_nvfp4(q[blk, off], s[blk, off], 0.5) if fmt == "nvfp4"
                    else dequantize_mxfp4(q[blk, off], s[blk, off]))
            assert valid[b, j] and torch.equal(out[b, j], want)
    e, v = kv_load_ref(q, s, table[:0], idx[:0], fmt)
    assert e.shape == (0, 5, 64) and v.shape == (0, 5)


def test_kv_store_then_load_roundtrip():
    x, slots, packed, scales = kv_store_case("nvfp4")
    kv_store_ref(x, slots, packed, scales, "nvfp4")
    keep = slots >= 0
    BE = packed.shape[1]
    table = torch.arange(packed.shape[0]).view(1, -1)
    out, _ = kv_load_ref(packed, scales, table, slots[keep].view(1, -1), "nvfp4")
    S = x[keep].unflatten(-1, (-1, 16)).abs().amax(-1, keepdim=True) / 6
    assert ((out[0] - x[keep]).unflatten(-1, (-1, 16)).abs() <= S * 17 / 16 + 1e-6).all()


def slow_attention(q, ring, ring_len, comp, valid, sinks, scale):
    B, H, D = q.shape
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        keys = [ring[b, w] for w in range(int(ring_len[b]))] + [comp[b, j] for j in range(comp.shape[1]) if valid[b, j]]
        for h in range(H):
            logits = [scale * float(q[b, h].double() @ k.double()) for k in keys]
            m = max(logits + [float(sinks[h])])
            den = math.exp(float(sinks[h]) - m) + sum(math.exp(s - m) for s in logits)
            for s, k in zip(logits, keys):
                out[b, h] += math.exp(s - m) / den * k.double()
    return out


def test_attention_ref_matches_loop():
    case = attention_case()
    got = v4_decode_attention_ref(*case)
    want = slow_attention(*case)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    assert not got[-1].any()                                 # only the sink: exact zeros
    q, ring, ring_len, comp, valid, sinks, sc = case
    empty = v4_decode_attention_ref(q[:0], ring[:0], ring_len[:0], comp[:0], valid[:0], sinks, sc)
    assert empty.shape == (0, 4, 32)


def slow_verify(c, N):
    R, k = c.shape
    c = np.clip(np.nan_to_num(c.numpy().astype(np.float32), nan=0.0), 0, 1)
    items = []
    for r in range(R):
        a = np.float32(1)
        for j in range(k):
            a = np.float32(a * c[r, j])
            items.append((-float(a), r, j))
    lens = [0] * R
    for _, r, _ in sorted(items)[:N]:
        lens[r] += 1
    return lens


@pytest.mark.parametrize("N", [0, 1, 5, 13, 28, 40])
def test_verify_len_ref_matches_loop(N):
    c = verify_case()
    got = verify_len_ref(c, N)
    assert got.tolist() == slow_verify(c, N)
    assert int(got.sum()) == min(N, c.numel())


def test_verify_len_sanitises_and_empty():
    c = torch.tensor([[0.9, float("nan"), 0.5], [1.5, 0.2, -1.0]])
    assert verify_len_ref(c, 4).tolist() == slow_verify(c, 4)
    assert verify_len_ref(torch.rand(0, 4) + 0.1, 3).shape == (0,)


def mix32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def slow_sample_row(logits, temp, top_k, top_p, min_p, seed, offset):
    z = [float(v) for v in logits]
    if all(v == -math.inf for v in z):
        return -1
    if temp <= 0:
        return max(range(len(z)), key=lambda i: (z[i], -i))
    z = [float(np.float32(v) / np.float32(temp)) for v in z]
    zmax = max(z)
    keep = [i for i in range(len(z)) if z[i] > -math.inf and math.exp(z[i] - zmax) >= min_p]
    keep.sort(key=lambda i: -z[i])
    if 0 < top_k < len(z) and len(keep) > top_k:
        thr = z[keep[top_k - 1]]
        keep = [i for i in keep if z[i] >= thr]
    if top_p < 1:
        total = sum(math.exp(z[i] - zmax) for i in keep)
        acc = 0.0
        for n, i in enumerate(keep):
            acc += math.exp(z[i] - zmax)
            if acc >= top_p * total:
                thr = z[i]
                break
        keep = [i for i in keep if z[i] >= thr]
    row = mix32(mix32(mix32(seed & 0xFFFFFFFF) ^ (seed >> 32)) ^ offset)
    best, tok = -math.inf, -1
    for i in sorted(keep):
        u = ((mix32(row ^ mix32(i)) >> 9) + 0.5) * 2.0 ** -23
        sc = z[i] - math.log(-math.log(u))
        if sc > best:
            best, tok = sc, i
    return tok


@pytest.mark.parametrize("first", [sampling.TOP_P_FIRST, 4])     # 4: top-p rows also take the full-sort path
def test_sample_ref_matches_loop(first, monkeypatch):
    monkeypatch.setattr(sampling, "TOP_P_FIRST", first)
    case = sampling_case()
    got = sample_ref(*case)
    logits, temp, top_k, top_p, min_p, seeds, offsets = case
    want = [slow_sample_row(logits[b], float(temp[b]), int(top_k[b]), float(top_p[b]), float(min_p[b]),
                            int(seeds[b]), int(offsets[b]) & 0xFFFFFFFF) for b in range(logits.shape[0])]
    assert got.tolist() == want
    assert got[-1] == -1 and got[0] == logits[0].argmax()
    assert logits[4].topk(1).indices.item() == got[4]         # top_k 1 is greedy
    assert sample_ref(*[t[:0] if isinstance(t, torch.Tensor) else t for t in case]).shape == (0,)


def test_sample_seed_reproducible_and_distributed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    ones = torch.ones(4000)
    args = (ones, torch.full((4000,), -1, dtype=torch.int32), ones, torch.zeros(4000))
    offsets = torch.full((4000,), 3)
    toks = sample_ref(logits, *args, torch.arange(4000), offsets)
    assert torch.equal(toks, sample_ref(logits, *args, torch.arange(4000), offsets))
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)  # Gumbel-max samples the softmax


def test_token_mask_ref_matches_loop():
    logits, mask = mask_case()
    got = apply_token_mask_ref(logits.clone(), mask)
    want = logits.clone()
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(mask[b, t // 32]) >> (t % 32)) & 1:
                want[b, t] = -math.inf
    assert torch.equal(got, want) and torch.isinf(got).any()
    assert apply_token_mask_ref(torch.randn(0, 70), torch.zeros(0, 3, dtype=torch.int32)).shape == (0, 70)


def test_bad_input_raises():
    x, slots, packed, scales = kv_store_case("nvfp4")
    with pytest.raises(ValueError, match="fmt"):
        kv_store_ref(x, slots, packed, scales, "fp8")
    with pytest.raises(ValueError, match="multiple"):
        kv_store_ref(x[:, :40], slots, packed, scales, "nvfp4")
    with pytest.raises(ValueError, match="packed"):
        kv_store_ref(x, slots, packed.float(), scales, "nvfp4")
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_mask_ref(torch.randn(2, 70), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="budget"):
        verify_len_ref(torch.rand(2, 2), -1)
    q, ring, ring_len, comp, valid, sinks, sc = attention_case()
    with pytest.raises(ValueError, match="sinks"):
        v4_decode_attention_ref(q, ring, ring_len, comp, valid, sinks[:2], sc)
    case = list(sampling_case())
    case[5] = case[5].int()
    with pytest.raises(ValueError, match="seeds"):
        sample_ref(*case)


def test_dispatch_cpu_uses_reference():
    logits, mask = mask_case()
    op = get_op("apply_token_mask")
    assert torch.equal(op(logits.clone(), mask), apply_token_mask_ref(logits.clone(), mask))
    assert get_op("verify_len", "reference") is verify_len_ref
    with pytest.raises(ValueError, match="unknown op"):
        get_op("nope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(B=5, H=16, D=128, W=16, K=9), dict(K=0), dict(D=37, W=3)])
def test_dispatch_cpu_decode_attention_is_the_cpp_kernel_and_matches_the_reference(dtype, shape, monkeypatch):
    """On CPU tensors the op is deepinfer's C++ kernel (a full ring, an empty ring, rows with only the sink,
    no compressed entries, a head dim that is not a multiple of the vector width); it agrees with the torch
    reference to fp32 rounding, or to one bf16 step after the single rounding of the result."""
    from deepinfer.layers import cpu_ops

    q, ring, ring_len, comp, valid, sinks, scale = attention_case(**shape)
    q, ring, comp = q.to(dtype), ring.to(dtype), comp.to(dtype)
    calls, kernel = [], cpu_ops.v4_decode_attention
    monkeypatch.setattr(cpu_ops, "v4_decode_attention", lambda *a: calls.append(1) or kernel(*a))
    out = get_op("v4_decode_attention")(q, ring, ring_len, comp, valid, sinks, scale)
    ref = v4_decode_attention_ref(q, ring, ring_len, comp, valid, sinks, scale)
    assert calls and out.dtype == dtype
    tol = dict(rtol=2 ** -7, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # nothing valid: exactly zero
