"""Every TileLang kernel lowered to CUDA for sm_90a and compiled with nvcc: no GPU needed, nvcc required.

A machine of this kind has nvcc; a missing nvcc fails (not skips) so a kernel that stops compiling is seen.
One shape per kernel (shapes are compile-time constants; more shapes would only cost build time).
"""
import shutil

import pytest

from tilelang_ops.common import cuda_source, nvcc_compile
from tilelang_ops.kv_load import make_kv_load
from tilelang_ops.kv_store import make_kv_store
from tilelang_ops.sampling import make_sample
from tilelang_ops.token_mask import make_token_mask
from tilelang_ops.v4_decode_attention import make_combine, make_v4_decode_attention
from tilelang_ops.verify_len import make_verify_len

# name -> (maker, compile-time args): DeepSeek-V4-Flash shapes (64 heads of 512, window 128, top-k 512 entries,
# 5 splits: B=64 on an H200's 132 SMs; vocabulary 129,280)
KERNELS = {
    "kv_store_nvfp4": (make_kv_store, ("nvfp4", 512, "bfloat16")),
    "kv_store_mxfp4": (make_kv_store, ("mxfp4", 128, "bfloat16")),
    "kv_load_nvfp4": (make_kv_load, ("nvfp4", 512, 64, "bfloat16")),
    "kv_load_mxfp4": (make_kv_load, ("mxfp4", 128, 64, "float32")),
    "v4_decode_attention": (make_v4_decode_attention, (64, 512, 128, 512, "bfloat16", 5)),
    "v4_decode_attention_nvfp4": (make_v4_decode_attention, (64, 512, 128, 512, "bfloat16", 5, "nvfp4", 64)),
    "v4_decode_attention_combine": (make_combine, (64, 512, 5, "bfloat16")),
    "verify_len": (make_verify_len, (8,)),
    "sample": (make_sample, (129280,)),
    "token_mask": (make_token_mask, (129280, "float32")),
}

# What the tile-level kernels must lower to: vector loads and stores, tensor-core GEMMs on shared tiles,
# block reductions
TILE_LEVEL = {
    "kv_store_nvfp4": ("*(uint4*)(X ",),
    "kv_store_mxfp4": ("*(uint4*)(X ", "AllReduce<tl::MaxOp"),
    "kv_load_nvfp4": ("*(uint4*)(P ", "*(uint1*)(Out "),
    "kv_load_mxfp4": ("*(uint4*)(P ", "*(float2*)(Out "),
    "v4_decode_attention": ("wgmma", "buf_dyn_shmem", "tl::AllReduce", "uint4"),
    "v4_decode_attention_nvfp4": ("wgmma", "buf_dyn_shmem", "tl::AllReduce", "uint4"),
    "v4_decode_attention_combine": ("float4",),
    "sample": ("buf_dyn_shmem", "AllReduce", "float4", "__launch_bounds__(1024"),   # shared histograms
}


@pytest.fixture(scope="session")
def cubin_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cubins"))


def test_nvcc_present():
    assert shutil.which("nvcc"), "nvcc not found: this machine kind must have the CUDA toolkit"


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_sm90a(name, cubin_dir):
    assert shutil.which("nvcc"), "nvcc not found: this machine kind must have the CUDA toolkit"
    maker, args = KERNELS[name]
    src = cuda_source(maker, *args)
    assert "__global__" in src and "threadIdx.x" in src
    for marker in TILE_LEVEL.get(name, ()):                  # not one thread per work item
        assert marker in src, f"{name}: no {marker!r} in its CUDA source"
    assert len(src) < 200_000, f"{name}: {len(src)} chars of CUDA (an expression tree blown up when lowered)"
    with open(nvcc_compile(src, cubin_dir, name), "rb") as f:
        assert f.read(4) == b"\x7fELF"                       # a real sm_90a cubin
