"""Shared plumbing for the TileLang kernels: thread indexing on both targets, builds, CUDA source, nvcc.

Every kernel here is written in one portable style: each logical work item (a token block, a head, a
row) is handled start to finish by one thread with serial loops and thread-local buffers, with no
cross-thread communication. On CUDA the items are spread over blocks of CUDA_THREADS threads; on the
C target (no SIMT threads) each item is its own grid step, so the same program runs on both.
"""
import functools
import os
import subprocess

import torch

CUDA_THREADS = 128
CUDA_ARCH = "sm_90a"
C_FLAGS = ["-O3", "-march=native"]


def threads_for(target: str) -> int:
    return CUDA_THREADS if target == "cuda" else 1


def item(bx, threads: int):
    """Global work-item index inside a kernel: block * threads + thread (plain block index on C)."""
    import tilelang.language as T
    return bx if threads == 1 else bx * threads + T.get_thread_binding(0)


def grid(n, threads: int):
    import tilelang.language as T
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
    """Compile maker(*args, threads) for target ('c' or 'cuda'); cached per (kernel, shape args, target)."""
    import tilelang
    func = maker(*args, threads_for(target))
    if target == "c":
        return tilelang.compile(func, target="c", compile_flags=C_FLAGS)
    return tilelang.compile(func, target="cuda")


def cuda_source(maker, *args, arch: str = CUDA_ARCH) -> str:
    """Lower maker(*args, CUDA_THREADS) to CUDA C++ for arch without needing a GPU."""
    import tilelang
    from tvm.target import Target
    with Target({"kind": "cuda", "arch": arch}) as tgt:
        return tilelang.lower(maker(*args, CUDA_THREADS), target=tgt).kernel_source


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


def check(cond: bool, msg: str):
    """Boundary validation: a clear ValueError before any launch."""
    if not cond:
        raise ValueError(msg)


def check_tensor(t, name: str, dtypes, ndim: int):
    check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor")
    check(t.dtype in dtypes, f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    check(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
