"""Large tensors re-homed onto huge-page mappings (deepinfer/memory.py): same values, 2 MiB aligned,
kept alive by the tensor, small tensors left alone; KV pools backed by memory before the first step; kernel
scratch kept through a step, not past it."""
import gc
import os

import pytest
import torch
from torch import nn

from deepinfer import _C
from deepinfer.engine.cache_engine import CacheEngine
from deepinfer.formats.cache_spec import CacheSpec, CacheTensor
from deepinfer.layers import cpu_ops
from deepinfer.memory import HUGE_PAGE, huge_page_zeros, prefault, to_huge_pages


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_huge_page_zeros_is_zeroed_aligned_and_writable():
    t = huge_page_zeros((3, HUGE_PAGE // 4 + 5), torch.float32)
    assert t.shape == (3, HUGE_PAGE // 4 + 5) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t.fill_(2.5)
    gc.collect()  # the mapping lives as long as the tensor, not as long as a Python name for it
    assert float(t.sum()) == 2.5 * t.numel()


def test_small_tensors_use_torch_allocator():
    t = huge_page_zeros((16, 16), torch.bfloat16)
    assert t.shape == (16, 16) and t.dtype == torch.bfloat16 and not t.any()


def test_to_huge_pages_moves_large_parameters_and_keeps_values():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(16, 4)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    small_ptr = model[1].weight.data_ptr()
    moved = to_huge_pages(model)
    assert moved == 1024 * 1024 * 2  # only the 2 MiB weight qualifies
    assert model[0].weight.data_ptr() % HUGE_PAGE == 0
    assert model[1].weight.data_ptr() == small_ptr
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert isinstance(model[0].weight, nn.Parameter)
    out = model[0](torch.ones(2, 1024, dtype=torch.bfloat16))
    assert torch.equal(out, torch.nn.functional.linear(torch.ones(2, 1024, dtype=torch.bfloat16), before["0.weight"],
                                                       before["0.bias"]))


def test_prefault_backs_every_page_and_keeps_zeros():
    start = _resident_bytes()
    t = huge_page_zeros((64 << 20,), torch.uint8)
    before = _resident_bytes()
    assert before - start < 8 << 20  # a fresh mapping is not resident yet
    prefault(t)
    assert _resident_bytes() - before >= 60 << 20
    assert not t.any()


def test_cache_engine_pools_are_resident_at_start():
    spec = CacheSpec(paged={"k": CacheTensor((16, 2, 64), torch.bfloat16)},
                     state={"ring": CacheTensor((1024,), torch.float32)})
    before = _resident_bytes()
    cache = CacheEngine(spec, kv_cache_memory=48 << 20, num_state_slots=4, block_size=16)
    assert _resident_bytes() - before >= cache.allocated_bytes - (2 << 20)
    assert not any(t.any() for t in [*cache.paged.values(), *cache.state.values()])


def test_kernel_scratch_is_kept_inside_a_scope_and_freed_after():
    g = torch.Generator().manual_seed(0)
    t, k, e, h, i = 2560, 2, 4, 1024, 64
    x, ids, wts = torch.randn(t, h, generator=g), torch.randint(0, e, (t, k), generator=g), torch.rand(t, k, generator=g)
    w13 = (0.05 * torch.randn(e, 2 * i, h, generator=g)).bfloat16()
    w2 = (0.05 * torch.randn(e, h, i, generator=g)).bfloat16()
    big = t * k * h * 4  # each of the MoE's row buffers: past the 16 MiB a buffer keeps outside a scope
    ref = cpu_ops.moe_experts_bf16(x, ids, wts, w13, w2)
    assert _C.scratch_bytes() < big
    with cpu_ops.scratch_kept():
        with cpu_ops.scratch_kept():  # nested: the inner end frees nothing
            first = cpu_ops.moe_experts_bf16(x, ids, wts, w13, w2)
        assert _C.scratch_bytes() >= 2 * big
        again = cpu_ops.moe_experts_bf16(x, ids, wts, w13, w2)
        assert _C.scratch_bytes() >= 2 * big
    assert _C.scratch_bytes() < big
    assert torch.equal(first, ref) and torch.equal(again, ref)
    with pytest.raises(ValueError, match="no keep scope is open"):
        _C.keep_scratch(False)
