"""What this machine and this build are: the CPU's features (read by the extension with cpuid), an id
of the compiled extension, and where the engine keeps what it measured on them. Caches of measured
numbers (GEMM plans, step-time curves) are keyed by both, so a kernel change or another CPU never
reuses a stale measurement. Also how the engine's threads are shared between our kernels and torch."""
import contextlib
import functools
import hashlib
import logging
import os

import torch

from deepinfer import _C

logger = logging.getLogger("deepinfer")


@functools.cache
def cpu_features() -> dict:
    """{"model": brand string, "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile",
    "amx_bf16": bool, "gemm_isas": [(name, id)] of our GEMM kernels that run here}."""
    return _C.cpu_features()


def cpu_flags() -> str:
    """The flags that decide which GEMM wins, as one line for logs and benchmark tables."""
    f = cpu_features()
    names = [k for k in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f[k]]
    return f"{f['model']} [{' '.join(names)}]"


@functools.cache
def build_id() -> str:
    """sha256 prefix of the compiled extension's bytes: changes with any kernel or compiler change."""
    with open(_C.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def cache_path(kind: str, *key) -> str:
    """A file under $DEEPINFER_CACHE_DIR (default ~/.cache/deepinfer)/kind/ named by the key, this CPU,
    torch's version and the extension's build."""
    root = os.environ.get("DEEPINFER_CACHE_DIR") or os.path.expanduser("~/.cache/deepinfer")
    full = repr((key, cpu_flags(), torch.__version__, build_id()))
    return os.path.join(root, kind, hashlib.sha256(full.encode()).hexdigest()[:16] + ".json")


# Threads our kernels split their work over (csrc/cpu/thread_pool); 0 until an engine sets them.
_kernel_threads = 0


def kernel_threads() -> int:
    """Our kernels' thread count: the engine's num_threads, or torch's count when no engine set one."""
    return _kernel_threads or torch.get_num_threads()


def set_threads(n: int) -> None:
    """Our kernels get n threads; torch's own ops get one, except inside torch_parallel() (prefill).
    torch's OpenMP workers spin after each parallel region on the very cores our pool's workers then
    need: medium Qwen3-MoE batch-1 decode on 2 vCPUs measured 20 ms with everything on one thread,
    36 ms with both at two, 16 ms with our kernels at two and torch at one."""
    global _kernel_threads
    _kernel_threads = n
    torch.set_num_threads(1)
    if n > 1 and "OMP_WAIT_POLICY" not in os.environ:  # deepinfer/__init__.py sets it unless torch came first
        logger.info("torch was imported before deepinfer with OMP_WAIT_POLICY unset: its OpenMP workers spin on the "
                    "cores our kernels need after each prefill op (a 64-token prefill at two threads ran ~1.6x "
                    "slower); set OMP_WAIT_POLICY=PASSIVE, or import deepinfer first")


@contextlib.contextmanager
def torch_parallel():
    """torch's ops on all kernel threads inside the block: prefill's large GEMMs and attention gain more
    from them than the spinning costs."""
    before = torch.get_num_threads()
    torch.set_num_threads(kernel_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)
