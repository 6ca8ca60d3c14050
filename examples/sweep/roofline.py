"""This machine's floor rates: read bandwidth and matmul rate, at 1 and 2 threads.

    python -m examples.sweep.roofline [--out roofline.json] [--threads 1 2]

Bandwidth: best of several full reads of 512 MiB (far past any cache), on 2 MiB huge pages where the kernel
gives them (deepinfer/memory.py: the engine keeps its weights there, and a core reads them ~1.35x faster than
from 4 KiB pages on the AMX Xeon), by torch's sum and by the engine's batch-1 GEMV, the faster of the two, so
the floor is the fastest read this machine offers.
Matmul: best of several [512 x 2048] @ [2048 x 2048] products in fp32 and in bf16, the faster of the two:
bf16 is the ceiling where the CPU multiplies bf16 natively (AMX, AVX512-BF16), fp32 where it does not (on
an AVX2-only machine torch's bf16 GEMM measured 0.2 GFLOP/s). Best-of, not mean: other jobs on the shared
machine only ever slow a run down."""
import argparse
import json
import os
import time


def best_time(fn, repeats: int) -> float:
    """Seconds of fn's fastest call of `repeats`, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemv_kernel() -> tuple[str, int, bool]:
    """(GEMM ISA name, kernel id, packed): how the engine reads bf16 weights at batch 1 here: its packed kernel
    where this CPU has one (the engine packs its bf16 weights there), else its default exact one."""
    from deepinfer.layers import cpu_ops

    packed = cpu_ops.PACKED_ISA is not None
    name = cpu_ops.PACKED_ISA if packed else cpu_ops.EXACT_ISA
    return name, cpu_ops.GEMM_ISAS[name], packed


def read_array(mib: int = 512):
    """mib MiB of fp32 ones (far past any cache), on 2 MiB huge pages where the kernel gives them."""
    import torch  # here, not at the top: the sweep's listing and tables import this file

    from deepinfer.memory import huge_page_zeros

    return huge_page_zeros((mib << 18,), torch.float32).fill_(1.0)


def gemv_reader(n: int, k: int, threads: int):
    """read(w_ptr): one row of ones through the engine's batch-1 GEMV (gemv_kernel) over the bf16 weight [n, k] at
    w_ptr, on `threads` threads."""
    import torch

    from deepinfer import _C

    x, out = torch.ones(1, k), torch.empty(1, n)
    _, isa, packed = gemv_kernel()

    def read(w_ptr: int) -> None:
        _C.linear_bf16(x.data_ptr(), w_ptr, 0, False, out.data_ptr(), False, 1, k, n, isa, False, packed, threads)
    return read


def bandwidth(threads: int, mib: int = 512, repeats: int = 10) -> float:
    """Bytes per second of the fastest streaming read measured: torch's sum over a large fp32 array, or one row
    through the engine's batch-1 GEMV over the same bytes as a bf16 weight [N, 1024] (its per-panel prefetching
    read up to 1.27x faster than the sum at one thread on a Zen 3): the floor is never slower than a read the
    engine itself makes."""
    a = read_array(mib)
    nbytes, k = a.numel() * 4, 1024
    read = gemv_reader(nbytes // 2 // k, k, threads)
    return nbytes / min(best_time(a.sum, repeats), best_time(lambda: read(a.data_ptr()), repeats))


def matmul_rates(m: int = 512, k: int = 2048, n: int = 2048, repeats: int = 5) -> dict:
    """FLOP/s of torch's products: {"matmul": the best of fp32 and bf16 (what a bf16 model's products can reach),
    "matmul_fp32": fp32's (an fp32 model's: on CPUs with bf16 dot products about half the best)}."""
    import torch

    from deepinfer import platform

    f = platform.cpu_features()
    # Without bf16 instructions torch's bf16 product is never the faster one, and timing it costs minutes.
    dtypes = (torch.float32, torch.bfloat16) if f["avx512_bf16"] or f["amx_bf16"] else (torch.float32,)
    rates = {}
    for dtype in dtypes:
        x, w = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        rates[dtype] = 2 * m * k * n / best_time(lambda: x @ w, repeats)
    return {"matmul": max(rates.values()), "matmul_fp32": rates[torch.float32]}


def matmul_for(rates: dict, fp32: bool) -> float:
    """The matmul rate of a roofline entry that a model's products can reach: fp32's for fp32 weights."""
    if not fp32:
        return rates["matmul"]
    if "matmul_fp32" not in rates:
        raise ValueError("this roofline entry has no fp32 matmul rate (measured before fp32 rates were kept): "
                         "rerun python -m examples.sweep.roofline")
    return rates["matmul_fp32"]


def measure(threads: int) -> dict:
    """All rates at one thread count (restores torch's previous setting)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {"threads": threads, "bandwidth": bandwidth(threads), **matmul_rates()}
    finally:
        torch.set_num_threads(old)


def machine() -> dict:
    import torch

    with open("/proc/cpuinfo") as f:
        name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown CPU")
    from deepinfer import platform

    return {"cpu": name, "cores": os.cpu_count(), "isa": torch.backends.cpu.get_cpu_capability(),
            "flags": platform.cpu_flags(), "load_avg": os.getloadavg()[0]}


def rates_for(roofline: dict, threads: int) -> dict:
    """The measured entry for a thread count (the nearest measured one below it otherwise)."""
    entries = sorted(roofline["rates"], key=lambda r: r["threads"])
    fit = [r for r in entries if r["threads"] <= threads] or entries[:1]
    return fit[-1]


def merge(old: dict, new: dict) -> dict:
    """Per thread count, the best rates of two measurements: contention only lowers a rate, so
    the higher one is closer to what the machine can do (and gives the stricter floor)."""
    best = {r["threads"]: dict(r) for r in old["rates"]}
    for r in new["rates"]:
        b = best.setdefault(r["threads"], dict(r))
        for k in ("bandwidth", "matmul", "matmul_fp32"):
            if k in r:
                b[k] = max(b.get(k, 0.0), r[k])
    return {"machine": new["machine"], "rates": sorted(best.values(), key=lambda r: r["threads"]),
            "measurements": old.get("measurements", 1) + 1}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--merge", action="store_true", help="keep the best of this and the existing --out file")
    args = ap.parse_args()
    result = {"machine": machine(), "rates": [measure(t) for t in args.threads]}
    for r in result["rates"]:
        print(f"threads {r['threads']}: read {r['bandwidth'] / 1e9:.1f} GB/s, matmul {r['matmul'] / 1e9:.1f} "
              f"GFLOP/s (fp32 {r['matmul_fp32'] / 1e9:.1f})")
    if args.out and args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            result = merge(json.load(f), result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
