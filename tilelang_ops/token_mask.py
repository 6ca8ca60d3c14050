"""Structured-output mask (xgrammar's layout): bit j of word i of bitmask [B, ceil(V/32)] int32 allows
token 32*i + j; disallowed logits are set to -inf in place. Returns the logits tensor."""
import torch
import tilelang.language as T

from tilelang_ops.args import check, check_token_mask
from tilelang_ops.common import build, grid, item, target_of, threads_for

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def apply_token_mask_ref(logits, bitmask):
    """logits [B, V] float (in place), bitmask [B, ceil(V/32)] int32."""
    check_token_mask(logits, bitmask)
    V = logits.shape[1]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, device=bitmask.device, dtype=torch.int32)) & 1
    allowed = bits.flatten(1)[:, :V].bool()
    return logits.masked_fill_(~allowed, float("-inf"))


def make_token_mask(V: int, dtype: str, target: str):
    """One work item = one (row, 32-bit word)."""
    threads = threads_for(target)
    B = T.dynamic("B")
    NW = (V + 31) // 32

    @T.prim_func
    def token_mask(Logits: T.Tensor((B, V), dtype), Mask: T.Tensor((B, NW), "int32")):
        with T.Kernel(grid(B * NW, threads), threads=threads) as bx:
            i = item(bx, threads)
            if i < B * NW:
                b, w = i // NW, i % NW
                for j in T.serial(32):
                    if T.And(w * 32 + j < V, T.bitwise_and(T.shift_right(Mask[b, w], j), 1) == 0):
                        Logits[b, w * 32 + j] = -T.infinity(dtype)
    return token_mask


def apply_token_mask(logits, bitmask):
    """TileLang version of apply_token_mask_ref (same arguments and result)."""
    check_token_mask(logits, bitmask)
    target = target_of(logits, bitmask)
    check(logits.dtype in DTYPES, f"apply_token_mask kernel: logits dtype {logits.dtype} unsupported")
    check(target == "cuda" or logits.dtype == torch.float32, "apply_token_mask kernel: the C target runs fp32 only")
    check(logits.is_contiguous() and bitmask.is_contiguous(), "apply_token_mask: logits and bitmask must be contiguous")
    if logits.numel():
        build(make_token_mask, target, logits.shape[1], DTYPES[logits.dtype])(logits, bitmask)
    return logits
