"""Large tensors re-homed onto huge-page mappings (deepinfer/memory.py): same values, 2 MiB aligned,
kept alive by the tensor, small tensors left alone."""
import gc

import torch
from torch import nn

from deepinfer.memory import HUGE_PAGE, huge_page_zeros, to_huge_pages


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
