"""GPU check: build every TileLang kernel on CUDA, compare with its torch reference, time both, and report
achieved bandwidth against the device's measured copy bandwidth for the memory-bound kernels.

    python -m tilelang_ops.gpu_check            # needs one CUDA GPU; prints a markdown table
Exit status 1 if any kernel disagrees with its reference beyond the tolerance for its dtype.
"""
import sys

import torch

from tilelang_ops import kv_load, kv_store, sampling, token_mask, v4_decode_attention, verify_len

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}   # max |kernel - ref| / max |ref|


def timed(fn, *args, iters=20):
    """Median ms per call over iters, after a warm-up call (which also builds the kernel)."""
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(nbytes=1 << 30):
    """Device-to-device copy bandwidth (read + write bytes per second), the practical floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(dst.copy_, src) / 1e6


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def kv_cases(fmt, D, dev, g):
    """Store then load cases for one format (a function, so the lambdas bind this format's tensors)."""
    out = []
    N, NB, BE = 4096, 2048, 64
    G = kv_store.GROUP[fmt]
    x = torch.randn(N, D, device=dev, generator=g).bfloat16()
    slots = torch.randperm(NB * BE, device=dev, generator=g)[:N]
    pk, sk = (torch.zeros(NB, BE, D // 2, dtype=torch.uint8, device=dev),
              torch.zeros(NB, BE, D // G, dtype=torch.uint8, device=dev))
    pr, sr = pk.clone(), sk.clone()
    out.append((f"kv_store {fmt} N={N} D={D} bf16", lambda: kv_store.kv_store(x, slots, pk, sk, fmt),
                lambda: kv_store.kv_store_ref(x, slots, pr, sr, fmt),
                lambda *_: float(not (torch.equal(pk, pr) and torch.equal(sk, sr))),
                N * (2 * D + D // 2 + D // G + 8), 0.0))
    B, K = 128, 512
    table = torch.randperm(NB, device=dev, generator=g)[:B * 16].view(B, 16)
    idx = torch.randint(0, 16 * BE, (B, K), device=dev, generator=g)
    idx[:, K - 37:] = -1
    out.append((f"kv_load {fmt} B={B} k={K} D={D} -> bf16",
                lambda: kv_load.kv_load(pr, sr, table, idx, fmt, dtype=torch.bfloat16)[0],
                lambda: kv_load.kv_load_ref(pr, sr, table, idx, fmt, dtype=torch.bfloat16)[0],
                rel_err, B * K * (D // 2 + D // G + 8 + 2 * D), TOL[torch.bfloat16]))
    return out


def cases(dev):
    """(name, kernel thunk, reference thunk, compare(k_out, r_out) -> error, bytes moved or None, tolerance)."""
    g = torch.Generator(device=dev).manual_seed(0)
    out = kv_cases("nvfp4", 512, dev, g) + kv_cases("mxfp4", 128, dev, g)
    B, H, D, W, K = 64, 64, 512, 128, 512
    q = torch.randn(B, H, D, device=dev, generator=g).bfloat16()
    ring = torch.randn(B, W, D, device=dev, generator=g).bfloat16()
    comp = torch.randn(B, K, D, device=dev, generator=g).bfloat16()
    ring_len = torch.randint(0, W + 1, (B,), device=dev, generator=g)
    valid = torch.rand(B, K, device=dev, generator=g) < 0.9
    sinks = torch.randn(H, device=dev, generator=g)
    args = (q, ring, ring_len, comp, valid, sinks, D ** -0.5)
    out.append((f"v4_decode_attention B={B} H={H} D={D} W={W} k={K} bf16",
                lambda: v4_decode_attention.v4_decode_attention(*args),
                lambda: v4_decode_attention.v4_decode_attention_ref(*args), rel_err,
                2 * (B * H * D * 2) + B * (W + K) * D * 2, TOL[torch.bfloat16]))
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


def main():
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (the CPU suite covers the C target and sm_90a builds)")
        return 2
    dev = "cuda"
    bw = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}, measured copy bandwidth {bw:.0f} GB/s\n")
    print("| kernel | error | tol | kernel ms | torch ref ms | speedup | GB/s | % of copy bw |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for name, kern, ref, cmp, nbytes, tol in cases(dev):
        k_out, r_out = kern(), ref()
        torch.cuda.synchronize()
        err = cmp(k_out, r_out)
        bad += err > tol
        tk, tr = timed(kern), timed(ref)
        gbs = f"{nbytes / tk / 1e6:.0f}" if nbytes else "-"
        pct = f"{100 * nbytes / tk / 1e6 / bw:.0f}%" if nbytes else "-"
        print(f"| {name} | {err:.2e}{' FAIL' if err > tol else ''} | {tol:g} | {tk:.3f} | {tr:.3f} | "
              f"{tr / tk:.2f}x | {gbs} | {pct} |")
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
