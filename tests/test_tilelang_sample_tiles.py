"""The tile-level sampling kernel: token for token equal to sample_ref on the C target (the same tiles,
histograms and reductions the GPU runs, walked serially); tests/test_tilelang_cuda.py builds it for sm_90a."""
import pytest
import torch

from tilelang_ops import sampling

V4_VOCAB = 129280                      # DeepSeek-V4
INF = float("inf")

# One row per setting: (temperature, top_k, top_p, min_p, logits kind)
ROWS = [
    (0.0, -1, 1.0, 0.0, "normal"),     # greedy
    (0.0, -1, 1.0, 0.0, "ties"),       # greedy: first index of a tied max
    (1.0, 1, 1.0, 0.0, "normal"),
    (0.8, 2, 1.0, 0.0, "normal"),
    (1.0, -2, 1.0, 0.0, "normal"),     # top_k V - 1 (filled in per V)
    (1.0, 50, 1.0, 0.3, "normal"),     # top_k above the kept count
    (1.0, -1, 0.1, 0.0, "normal"),
    (1.3, -1, 0.5, 0.0, "normal"),
    (0.7, -1, 0.95, 0.0, "normal"),
    (1.0, -1, 0.0, 0.0, "normal"),     # top_p 0: the top token (and its ties) only
    (1.0, 20, 0.9, 0.05, "normal"),
    (1.0, -1, 1.0, 0.1, "normal"),
    (1.0, 3, 1.0, 0.0, "ties"),        # the k-th value tied: all its ties kept
    (1.0, -1, 0.5, 0.0, "ties"),
    (1.0, 7, 0.8, 0.0, "ties"),
    (0.9, 5, 0.95, 0.02, "some_inf"),
    (1.0, -1, 1.0, 0.0, "some_inf"),
    (1.0, 10, 0.9, 0.0, "all_inf"),    # nothing allowed -> -1
    (0.0, -1, 1.0, 0.0, "all_inf"),
]


def batch(V, seed, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    logits = torch.randn(B, V, generator=g) * 3
    temp, top_k, top_p, min_p = (torch.tensor(c) for c in list(zip(*rows))[:4])
    top_k = torch.where(top_k == -2, V - 1, top_k).int()
    for b, kind in enumerate(r[4] for r in rows):
        if kind == "ties":
            logits[b] = (logits[b] * 2).round() / 2
        elif kind == "some_inf":
            logits[b, torch.rand(V, generator=g) < 0.4] = -INF
        elif kind == "all_inf":
            logits[b] = -INF
    seeds = torch.randint(0, 2 ** 62, (B,), generator=g)
    offsets = torch.randint(0, 2 ** 40, (B,), generator=g)
    return logits, temp.float(), top_k, top_p.float(), min_p.float(), seeds, offsets


@pytest.mark.parametrize("V", [300, 5003, 8192])    # below one tile; a ragged odd tail; whole tiles
def test_sample_tiles_equal_ref_c(V):
    for seed in range(3):
        case = batch(V, seed)
        got = sampling.sample(*case)
        assert torch.equal(got, sampling.sample_ref(*case)), (V, seed)
        assert got[-1] == -1 and got[-2] == -1 and got[0] == case[0][0].argmax()


@pytest.mark.parametrize("V", [300, 5003])
def test_sample_tiles_draws_spread_over_kept_set_c(V):
    """Flat logits, each setting drawn with 16 offsets: the draws spread over the kept set, so a threshold
    off by one token changes some of them."""
    rows = [(1.0, 2, 1.0, 0.0, "ties"), (1.0, 9, 1.0, 0.0, "normal"), (1.0, -1, 0.5, 0.0, "ties"),
            (1.0, -1, 0.3, 0.0, "normal"), (1.0, 30, 0.9, 0.02, "normal")] * 16
    case = batch(V, 11, rows)
    case[0][:] = case[0][:len(rows) // 16].repeat(16, 1) / 3         # same logits per setting, flatter
    got = sampling.sample(*case)
    assert torch.equal(got, sampling.sample_ref(*case))
    assert len(set(got[::5].tolist())) > 1                          # the draws do spread


def test_sample_tiles_v4_vocab_c():
    rows = [(0.0, -1, 1.0, 0.0, "ties"), (1.0, 40, 0.9, 0.01, "normal"), (0.8, -1, 0.95, 0.0, "some_inf")]
    case = batch(V4_VOCAB, 7, rows)
    case[0][0, [5, V4_VOCAB - 3]] = 100.0               # greedy tie far apart: the first wins
    got = sampling.sample(*case)
    assert torch.equal(got, sampling.sample_ref(*case))
    assert got[0] == 5

