"""GPU check: build every TileLang kernel on CUDA, compare with its torch reference, time both, and report
achieved bandwidth against the device's measured copy bandwidth for the memory-bound kernels.

    python -m tilelang_ops.gpu_check            # needs one CUDA GPU; prints a markdown table
    python -m tilelang_ops.gpu_check --c        # the same cases on TileLang's C target in fp32, one CPU thread
Exit status 1 if any kernel disagrees with its reference beyond the tolerance for its dtype. The --c run is
the CPU evidence: the same tiles, splits and histograms at the same shapes, walked serially (its timings say
nothing about a GPU's).
"""
import logging
import sys
import time

import torch

from deepinfer.platform import cpu_flags
from tilelang_ops import kv_load, kv_store, sampling, token_mask, v4_decode_attention, verify_len
from tilelang_ops.args import GROUP

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}   # max |kernel - ref| / max |ref|
NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def timed(dev, fn, *args, iters=20):
    """Median ms per call over iters (3 on the CPU), after a warm-up call (which also builds the kernel)."""
    fn(*args)
    if dev != "cpu":
        torch.cuda.synchronize()
    times = sorted(_call_ms(dev, fn, *args) for _ in range(3 if dev == "cpu" else iters))
    return times[len(times) // 2]


def _call_ms(dev, fn, *args) -> float:
    """One call's time: wall clock on the CPU, CUDA events (then a sync) on the GPU."""
    if dev == "cpu":
        start = time.perf_counter()
        fn(*args)
        return 1000 * (time.perf_counter() - start)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(*args)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def copy_bandwidth_gbs(nbytes=1 << 30):
    """Device-to-device copy bandwidth (read + write bytes per second), the practical floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed("cuda", dst.copy_, src) / 1e6


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def kv_cases(fmt, D, dev, g, dt):
    """Store then load cases for one format (a function, so the lambdas bind this format's tensors)."""
    out = []
    N, NB, BE = 4096, 2048, 64
    G = GROUP[fmt]
    x = torch.randn(N, D, device=dev, generator=g).to(dt)
    slots = torch.randperm(NB * BE, device=dev, generator=g)[:N]
    pk, sk = (torch.zeros(NB, BE, D // 2, dtype=torch.uint8, device=dev),
              torch.zeros(NB, BE, D // G, dtype=torch.uint8, device=dev))
    pr, sr = pk.clone(), sk.clone()
    out.append((f"kv_store {fmt} N={N} D={D} {NAME[dt]}", lambda: kv_store.kv_store(x, slots, pk, sk, fmt),
                lambda: kv_store.kv_store_ref(x, slots, pr, sr, fmt),
                lambda *_: float(not (torch.equal(pk, pr) and torch.equal(sk, sr))),
                N * (dt.itemsize * D + D // 2 + D // G + 8), 0.0))
    B, K = 128, 512
    table = torch.randperm(NB, device=dev, generator=g)[:B * 16].view(B, 16)
    idx = torch.randint(0, 16 * BE, (B, K), device=dev, generator=g)
    idx[:, K - 37:] = -1
    out.append((f"kv_load {fmt} B={B} k={K} D={D} -> {NAME[dt]}",
                lambda: kv_load.kv_load(pr, sr, table, idx, fmt, dtype=dt)[0],
                lambda: kv_load.kv_load_ref(pr, sr, table, idx, fmt, dtype=dt)[0],
                rel_err, B * K * (D // 2 + D // G + 8 + dt.itemsize * D), TOL[dt]))
    return out


def fp4_attention_case(q, ring, ring_len, sinks, K, dev, g, BE=64):
    """Decode attention reading its K compressed entries straight from an NVFP4 pool (dequantised in the
    tile) against the torch path it replaces: kv_load to bf16, then attention."""
    B, H, D = q.shape
    NB = B * K // BE
    pool = torch.randn(NB * BE, D, device=dev, generator=g).to(q.dtype)
    packed = torch.zeros(NB, BE, D // 2, dtype=torch.uint8, device=dev)
    scales = torch.zeros(NB, BE, D // 16, dtype=torch.uint8, device=dev)
    kv_store.kv_store_ref(pool, torch.arange(NB * BE, device=dev), packed, scales, "nvfp4")
    table = torch.randperm(NB, device=dev, generator=g).view(B, K // BE)
    idx = torch.randint(0, K, (B, K), device=dev, generator=g)
    idx[:, K - 37:] = -1
    args = (q, ring, ring_len, packed, scales, table, idx, sinks, D ** -0.5, "nvfp4")
    return (f"v4_decode_attention nvfp4 entries B={B} H={H} D={D} k={K} {NAME[q.dtype]}",
            lambda: v4_decode_attention.v4_decode_attention_fp4(*args),
            lambda: v4_decode_attention.v4_decode_attention_fp4_ref(*args), rel_err,
            (2 * B * H + B * ring.shape[1]) * D * q.dtype.itemsize + B * K * (D // 2 + D // 16 + 8), TOL[q.dtype])


def cases(dev, dt=torch.bfloat16):
    """(name, kernel thunk, reference thunk, compare(k_out, r_out) -> error, bytes moved or None, tolerance)."""
    g = torch.Generator(device=dev).manual_seed(0)
    out = kv_cases("nvfp4", 512, dev, g, dt) + kv_cases("mxfp4", 128, dev, g, dt)
    B, H, D, W, K = 64, 64, 512, 128, 512
    q = torch.randn(B, H, D, device=dev, generator=g).to(dt)
    ring = torch.randn(B, W, D, device=dev, generator=g).to(dt)
    comp = torch.randn(B, K, D, device=dev, generator=g).to(dt)
    ring_len = torch.randint(0, W + 1, (B,), device=dev, generator=g)
    valid = torch.rand(B, K, device=dev, generator=g) < 0.9
    sinks = torch.randn(H, device=dev, generator=g)
    args = (q, ring, ring_len, comp, valid, sinks, D ** -0.5)
    out.append((f"v4_decode_attention B={B} H={H} D={D} W={W} k={K} {NAME[dt]}",
                lambda: v4_decode_attention.v4_decode_attention(*args),
                lambda: v4_decode_attention.v4_decode_attention_ref(*args), rel_err,
                (2 * B * H + B * (W + K)) * D * dt.itemsize, TOL[dt]))
    out.append(fp4_attention_case(q, ring, ring_len, sinks, K, dev, g))
    c = torch.rand(256, 8, device=dev, generator=g)
    out.append(("verify_len R=256 k=8 N=700", lambda: verify_len.verify_len(c, 700),
                lambda: verify_len.verify_len_ref(c, 700), lambda a, b: float(not torch.equal(a, b)), None, 0.0))
    B, V = 64, 129280
    logits = torch.randn(B, V, device=dev, generator=g) * 3
    sargs = (logits, torch.rand(B, device=dev, generator=g) + 0.3, torch.randint(-1, 100, (B,), device=dev,
             generator=g).int(), torch.rand(B, device=dev, generator=g) * 0.5 + 0.5, torch.zeros(B, device=dev),
             torch.randint(0, 2 ** 40, (B,), device=dev, generator=g),
             torch.randint(0, 4096, (B,), device=dev, generator=g))
    out.append((f"sample B={B} V={V}", lambda: sampling.sample(*sargs), lambda: sampling.sample_ref(*sargs),
                lambda a, b: (a != b).float().mean().item(), None, 0.02))  # fp32 sum order may flip a boundary
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, (V + 31) // 32), dtype=torch.int32, device=dev, generator=g)
    lk, lr = logits.clone(), logits.clone()
    out.append((f"token_mask B={B} V={V} fp32", lambda: token_mask.apply_token_mask(lk, mask),
                lambda: token_mask.apply_token_mask_ref(lr, mask), lambda a, b: float(not torch.equal(a, b)),
                B * V * 8 + mask.numel() * 4, 0.0))
    return out


def main(argv=None):
    on_c = "--c" in (sys.argv[1:] if argv is None else argv)
    if not on_c and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (--c runs the cases on the C target)")
        return 2
    logging.getLogger("tilelang").setLevel(logging.WARNING)  # its per-build INFO lines would land in the table
    dev, dt = ("cpu", torch.float32) if on_c else ("cuda", torch.bfloat16)
    if on_c:
        torch.set_num_threads(1)
    # A serial C program's bytes per second say nothing of the kernel: no bandwidth columns there.
    bw = None if on_c else copy_bandwidth_gbs()
    print(f"device: C target, CPU `{cpu_flags()}`, 1 thread\n" if on_c else
          f"device: {torch.cuda.get_device_name()}, measured copy bandwidth {bw:.0f} GB/s\n")
    print("| kernel | error | tol | kernel ms | torch ref ms | speedup | GB/s | % of copy bw |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for name, kern, ref, cmp, nbytes, tol in cases(dev, dt):
        k_out, r_out = kern(), ref()
        if not on_c:
            torch.cuda.synchronize()
        err = cmp(k_out, r_out)
        bad += err > tol
        tk, tr = timed(dev, kern), timed(dev, ref)
        gbs = f"{nbytes / tk / 1e6:.0f}" if nbytes and bw else "-"
        pct = f"{100 * nbytes / tk / 1e6 / bw:.0f}%" if nbytes and bw else "-"
        print(f"| {name} | {err:.2e}{' FAIL' if err > tol else ''} | {tol:g} | {tk:.3f} | {tr:.3f} | "
              f"{tr / tk:.2f}x | {gbs} | {pct} |", flush=True)
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
