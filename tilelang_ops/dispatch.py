"""The one dispatch point: get_op(name) -> callable that runs the TileLang kernel when its tensors are on
CUDA; on CPU tensors the op's C++ CPU kernel where it has one (CPU_KERNELS), else the torch reference
(the TileLang C target is for tests, not for the CPU engine)."""
import importlib

import torch

# name -> (module, kernel, reference)
OPS = {
    "kv_store": ("kv_store", "kv_store", "kv_store_ref"),
    "kv_load": ("kv_load", "kv_load", "kv_load_ref"),
    "v4_decode_attention": ("v4_decode_attention", "v4_decode_attention", "v4_decode_attention_ref"),
    "v4_decode_attention_fp4": ("v4_decode_attention", "v4_decode_attention_fp4", "v4_decode_attention_fp4_ref"),
    "verify_len": ("verify_len", "verify_len", "verify_len_ref"),
    "sample": ("sampling", "sample", "sample_ref"),
    "apply_token_mask": ("token_mask", "apply_token_mask", "apply_token_mask_ref"),
}

# name -> "module:function" of a C++ CPU kernel with the reference's arguments and result.
CPU_KERNELS = {
    "kv_load": "deepinfer.layers.cpu_ops:kv_load",
    "kv_store": "deepinfer.layers.cpu_ops:kv_store",
    "v4_decode_attention": "deepinfer.layers.cpu_ops:v4_decode_attention",
    "apply_token_mask": "deepinfer.layers.cpu_ops:apply_token_mask",
    "sample": "deepinfer.layers.cpu_ops:sample",
}


def _first_tensor(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def get_op(name: str, impl: str = "auto"):
    """impl: 'auto' (kernel on CUDA tensors, else the CPU kernel or the reference), 'kernel' or 'reference'."""
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known: {sorted(OPS)}")
    if impl not in ("auto", "kernel", "reference"):
        raise ValueError(f"impl must be 'auto', 'kernel' or 'reference', got {impl!r}")
    mod, kern, ref = OPS[name]

    def module():
        """Imported on first need: importing TileLang takes ~2.5 s, which an engine whose ops all have CPU kernels
        would spend at every start for nothing."""
        return importlib.import_module(f"tilelang_ops.{mod}")

    if impl != "auto":
        return getattr(module(), kern if impl == "kernel" else ref)

    cpu_kernel = CPU_KERNELS.get(name)

    def op(*args, **kwargs):  # resolved per call, so a patched kernel or reference is the one that runs
        t = _first_tensor(args, kwargs)
        if t is not None and t.is_cuda:
            fn = getattr(module(), kern)
        elif cpu_kernel:
            mod_name, fn_name = cpu_kernel.split(":")
            fn = getattr(importlib.import_module(mod_name), fn_name)
        else:
            fn = getattr(module(), ref)
        return fn(*args, **kwargs)
    op.__name__ = name
    return op
