"""Verify-length redistribution: the GPU half of DSpark's verify-length greedy.

The CPU fixes the step's total draft budget N; with fresh per-draft confidences c [R, k] this admits the
N drafts of highest survival a[r, j] = c[r, 0] * ... * c[r, j] (fp32, multiplied left to right) and
returns per-request prefix lengths l [R] int32 (sum(l) = min(N, R * k)). Ties: lower request, then
lower j. Confidences are probabilities: NaN counts as 0 and values are clamped to [0, 1], so survival is
non-increasing along j and, with the tie rule, every request's admitted set is a prefix.
"""
import torch
import tilelang.language as T

from tilelang_ops.args import check, check_tensor
from tilelang_ops.common import build, grid, item, target_of, threads_for


def sanitize(c: torch.Tensor) -> torch.Tensor:
    """NaN -> 0, clamp to [0, 1], fp32 contiguous: what both versions actually rank."""
    return torch.nan_to_num(c.float(), nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0).contiguous()


def survival(c: torch.Tensor) -> torch.Tensor:
    """[R, k] -> cumulative products in fp32, left to right (torch.cumprod may accumulate in double)."""
    a = c.clone()
    for j in range(1, c.shape[1]):
        a[:, j] = a[:, j - 1] * c[:, j]
    return a


def verify_len_ref(c, N: int):
    """c [R, k] confidences, N total drafts -> l [R] int32 prefix lengths."""
    _validate(c, N)
    R, k = c.shape
    a = survival(sanitize(c)).flatten()
    order = torch.sort(a, descending=True, stable=True).indices   # stable: flat (r, j) order breaks ties
    admitted = torch.zeros(R * k, dtype=torch.bool, device=c.device)
    admitted[order[:min(N, R * k)]] = True
    admitted = admitted.view(R, k)
    return admitted.int().cumprod(1).sum(1).int()                   # longest admitted prefix


def make_verify_len(k: int, target: str):
    """One work item = one request r: ranks each of its drafts against every draft of every request."""
    threads = threads_for(target)
    R = T.dynamic("R")

    @T.prim_func
    def verify_len(C: T.Tensor((R, k), "float32"), Budget: T.Tensor((1,), "int32"), L: T.Tensor((R,), "int32")):
        with T.Kernel(grid(R, threads), threads=threads) as bx:
            r = item(bx, threads)
            a = T.alloc_local((2,), "float32")       # own survival, other's survival
            cnt = T.alloc_local((2,), "int32")       # drafts beating (r, j), admitted prefix length
            if r < R:
                a[0] = 1.0
                cnt[1] = 0
                for j in T.serial(k):
                    a[0] = a[0] * C[r, j]
                    cnt[0] = 0
                    for r2 in T.serial(R):
                        a[1] = 1.0
                        for j2 in T.serial(k):
                            a[1] = a[1] * C[r2, j2]
                            if T.Or(a[1] > a[0], T.And(a[1] == a[0], r2 * k + j2 < r * k + j)):
                                cnt[0] += 1
                    if T.And(cnt[0] < Budget[0], cnt[1] == j):
                        cnt[1] = j + 1
                L[r] = cnt[1]
    return verify_len


def verify_len(c, N: int):
    """TileLang version of verify_len_ref (same arguments and result)."""
    _validate(c, N)
    R, k = c.shape
    out = torch.zeros(R, dtype=torch.int32, device=c.device)
    if R * k == 0:
        return out
    budget = torch.tensor([min(N, R * k)], dtype=torch.int32, device=c.device)
    build(make_verify_len, target_of(c), k)(sanitize(c), budget, out)
    return out


def _validate(c, N):
    check_tensor(c, "c", (torch.float32, torch.bfloat16, torch.float16, torch.float64), 2)
    check(isinstance(N, int) and N >= 0, f"verify_len: budget N must be a non-negative int, got {N!r}")
