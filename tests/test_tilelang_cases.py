"""Random inputs shared by the tilelang tests (fresh draws, never zeros; ragged batches and empty ones)."""
import torch

from deepinfer.formats.fp4 import quantize_mxfp4, quantize_nvfp4

G = {"nvfp4": 16, "mxfp4": 32}


def kv_store_case(fmt, N=9, D=64, NB=4, BE=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g) * torch.exp2(torch.randint(-5, 6, (N, 1), generator=g).float())
    slots = torch.randperm(NB * BE, generator=g)[:N]
    slots[torch.rand(N, generator=g) < 0.25] = -1          # padding tokens
    packed = torch.randint(0, 256, (NB, BE, D // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 120, (NB, BE, D // G[fmt]), dtype=torch.uint8, generator=g)
    return x, slots, packed, scales


def kv_load_case(fmt, B=3, K=5, D=64, NB=6, BE=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(NB, BE, D, generator=g)
    q, s = quantize_nvfp4(src, 0.5) if fmt == "nvfp4" else quantize_mxfp4(src)
    mb = 3
    table = torch.stack([torch.randperm(NB, generator=g)[:mb] for _ in range(B)])
    idx = torch.randint(0, mb * BE, (B, K), generator=g)
    lens = torch.randint(0, K + 1, (B,), generator=g)       # ragged: row b keeps lens[b] entries
    idx[torch.arange(K).view(1, K) >= lens.view(B, 1)] = -1
    return q, s, table, idx


def attention_case(B=4, H=4, D=32, W=8, K=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    ring = torch.randn(B, W, D, generator=g)
    comp = torch.randn(B, K, D, generator=g)
    ring_len = torch.randint(0, W + 1, (B,), generator=g)
    ring_len[0], ring_len[-1] = W, 0
    valid = torch.rand(B, K, generator=g) < 0.6
    valid[-1] = False                                       # last row: only the sink
    sinks = torch.randn(H, generator=g)
    return q, ring, ring_len, comp, valid, sinks, D ** -0.5


def verify_case(R=7, k=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(R, k, generator=g) * 0.9 + 0.05
    c[1, :2] = 1.0                                          # ties across and within requests
    c[3] = 0.5
    c[4, 1] = c[4, 0]
    return c


def sampling_case(B=8, V=300, seed=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    logits[6, ::3] = float("-inf")
    logits[7] = float("-inf")                               # nothing allowed -> -1
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 1.0])[:B]
    top_k = torch.tensor([-1, 5, -1, 20, 1, 50, 7, -1], dtype=torch.int32)[:B]
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.9, 1.0, 0.5, 0.95, 1.0])[:B]
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0])[:B]
    seeds = torch.randint(0, 2 ** 62, (B,), generator=g)
    offsets = torch.randint(0, 2 ** 40, (B,), generator=g)        # per row: tokens generated so far
    return logits, temp, top_k, top_p, min_p, seeds, offsets


def mask_case(B=3, V=70, seed=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, (V + 31) // 32), dtype=torch.int32, generator=g)
    return logits, mask
