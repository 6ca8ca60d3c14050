"""What this machine and this build are: the CPU's features (read by the extension with cpuid), an id
of the compiled extension, and where the engine keeps what it measured on them. Caches of measured
numbers (GEMM plans, step-time curves) are keyed by both, so a kernel change or another CPU never
reuses a stale measurement."""
import functools
import hashlib
import os

import torch

from deepinfer import _C


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
