"""Large CPU tensors (weights, KV pools) on 2 MiB transparent huge pages.

Decode streams every weight once per step, so its speed is the single-core read rate. On 4 KiB pages
each page is a TLB miss and a fresh start for the hardware prefetcher: the expert weights of the medium
Qwen3-MoE read at 11.2 GB/s on one core (21 GB/s on two) of the AMX Xeon, and at 15.2 (30) GB/s from
huge pages. Kernels with THP in "madvise" mode (the default of most distributions) give huge pages only
to memory that asks for them, and torch's allocator does not ask (unless THP_MEM_ALLOC_ENABLE is set
before its first allocation), so large tensors are re-homed into madvised anonymous mappings here.
Elsewhere (no madvise, THP off) the tensors stay where they are.
"""
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor [shape] starting on a 2 MiB boundary of a mapping that asks for huge pages;
    torch.zeros for tensors under one huge page or where madvise is unavailable."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # Anonymous mappings are zero-filled and 4 KiB aligned: one spare huge page lets the data start on a
    # 2 MiB boundary, so every whole huge page of it can be backed by one.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()  # the tensor keeps buf alive
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=-base % HUGE_PAGE).view(shape)


def prefault(t: torch.Tensor) -> None:
    """Backs every page of contiguous t with memory now (one write of zero per 4 KiB page; t is zeroed memory):
    a page's first write costs a fault and the kernel's zeroing of the page (2 MiB at once on huge pages), which a
    decode step first writing a KV block would pay inside the step (batch 64 of the medium Qwen3-MoE: 62 such
    faults in 63 steps, the kernel's page clearing 1.5-1.7% of the decode's perf samples on a Zen 3)."""
    t.view(-1).view(torch.uint8)[::4096].zero_()


def to_huge_pages(model: nn.Module) -> int:
    """Moves every CPU parameter and buffer of at least one huge page into huge_page_zeros memory.
    Returns the bytes moved."""
    moved = 0
    for t in list(model.parameters()) + list(model.buffers()):
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < HUGE_PAGE or not t.is_contiguous():
            continue
        home = huge_page_zeros(tuple(t.shape), t.dtype)
        if home.data_ptr() == t.data_ptr():
            continue
        home.copy_(t.data)
        t.data = home
        moved += nbytes
    return moved
