"""Shared plumbing for the TileLang kernels: the tile primitives on both targets, builds, CUDA source, nvcc.

A kernel is one program for both targets. Its makers take the target and write the program with `Tiles`,
which spells each tile primitive the way the target has it: on CUDA a block of threads shares tiles in
shared memory and fragments, and `T.reduce_*` reduces across threads; on the C target (no SIMT threads:
`T.Parallel` runs serially, fragments and shared memory do not exist) the same tiles are local buffers
and a reduction is a serial loop. So the algorithm the C target tests is the one the GPU runs.
`item`/`grid` serve the kernels still written one work item per thread (verify_len, token_mask).
"""
import functools
import os
import subprocess

import tilelang.cpu.language as TC
import tilelang.language as T
import torch

from tilelang_ops.args import check

CUDA_THREADS = 128
CUDA_ARCH = "sm_90a"
C_FLAGS = ["-O3", "-march=native"]


def threads_for(target: str) -> int:
    return CUDA_THREADS if target == "cuda" else 1


class Tiles:
    """The tile primitives for one target ('cuda' or 'c'); `threads` is the CUDA block size."""

    def __init__(self, target: str, threads: int = CUDA_THREADS):
        self.cuda = target == "cuda"
        self.threads = threads if self.cuda else 1

    def kernel(self, *grid):
        return T.Kernel(*grid, threads=self.threads) if self.cuda else TC.Kernel(*grid)

    def parallel(self, *extents):
        """T.Parallel (elements spread over the threads) on CUDA; nested serial loops on C, where the tiles
        are local buffers and TileLang forbids indexing those with a T.Parallel variable."""
        return T.Parallel(*extents) if self.cuda else T.grid(*extents)

    def fragment(self, shape, dtype):
        """Registers spread over the block's threads (CUDA) / a local array (C)."""
        return (T.alloc_fragment if self.cuda else T.alloc_local)(shape, dtype)

    def shared(self, shape, dtype):
        return (T.alloc_shared if self.cuda else T.alloc_local)(shape, dtype)

    def reduce_max(self, src, dst, dim: int = -1, clear: bool = True):
        return self._reduce(T.reduce_max, T.max, -T.infinity(src.dtype), src, dst, dim, clear)

    def reduce_min(self, src, dst, dim: int = -1, clear: bool = True):
        return self._reduce(T.reduce_min, T.min, T.max_value(src.dtype), src, dst, dim, clear)

    def reduce_sum(self, src, dst, dim: int = -1, clear: bool = True):
        return self._reduce(T.reduce_sum, lambda a, b: a + b, T.Cast(src.dtype, 0), src, dst, dim, clear)

    def _reduce(self, block_reduce, op, init, src, dst, dim, clear):
        """block_reduce (T.reduce_*) across the threads on CUDA; on C a serial loop folding op from init."""
        if self.cuda:
            return block_reduce(src, dst, dim=dim, clear=clear)
        return _serial_reduce(src, dst, dim, clear, op, init)


def _serial_reduce(src, dst, dim, clear, op, init):
    """T.reduce_* for the C target: src [n] -> dst [1], or src [r, c] along its last dim -> dst [r]."""
    two_d = len(src.shape) == 2
    check(dim in (-1, len(src.shape) - 1), f"C-target reduction over dim {dim} of a {len(src.shape)}-d tile")
    outer, inner = (src.shape[0], src.shape[1]) if two_d else (1, src.shape[0])
    at = (lambda i, j: src[i, j]) if two_d else (lambda i, j: src[j])  # noqa: E731

    @T.macro
    def reduce():
        for i in T.serial(outer):
            if clear:
                dst[i] = init
            for j in T.serial(inner):
                dst[i] = op(dst[i], at(i, j))
    return reduce()


def item(bx, threads: int):
    """Global work-item index inside a kernel: block * threads + thread (plain block index on C)."""
    return bx if threads == 1 else bx * threads + T.get_thread_binding(0)


def grid(n, threads: int):
    return T.ceildiv(n, threads)


def target_of(*tensors: torch.Tensor) -> str:
    """'cuda' when every tensor is on a GPU, 'c' when all are on the CPU; a mix is a caller bug."""
    kinds = {t.device.type for t in tensors}
    if kinds == {"cuda"}:
        return "cuda"
    if kinds == {"cpu"}:
        return "c"
    raise ValueError(f"tensors must all be on one device kind (cpu or cuda), got {sorted(kinds)}")


@functools.lru_cache(maxsize=None)
def build(maker, target: str, *args):
    """Compile maker(*args, target=target) for target ('c' or 'cuda'); cached per (kernel, args, target)."""
    import tilelang
    func = maker(*args, target=target)
    if target == "c":
        return tilelang.compile(func, target="c", compile_flags=C_FLAGS)
    return tilelang.compile(func, target="cuda")


def cuda_source(maker, *args, arch: str = CUDA_ARCH) -> str:
    """Lower maker(*args, target='cuda') to CUDA C++ for arch without needing a GPU."""
    import tilelang
    from tvm.target import Target
    with Target({"kind": "cuda", "arch": arch}) as tgt:
        return tilelang.lower(maker(*args, target="cuda"), target=tgt).kernel_source


def nvcc_compile(source: str, out_dir: str, name: str, arch: str = CUDA_ARCH) -> str:
    """Compile CUDA source to a cubin with nvcc (must exist); returns the cubin path, raises with nvcc's log."""
    from tilelang.contrib.nvcc import default_compile_options
    cu, cubin = os.path.join(out_dir, name + ".cu"), os.path.join(out_dir, name + ".cubin")
    with open(cu, "w") as f:
        f.write(source)
    cmd = ["nvcc", "-cubin", "-O3", f"-arch={arch}", "-w", *default_compile_options(), "-o", cubin, cu]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {name}:\n{proc.stdout}\n{proc.stderr}")
    return cubin
