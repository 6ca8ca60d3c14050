"""csrc/cpu kernels against plain torch on random shapes, including ragged tails."""
import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, _C, platform
from deepinfer.layers import cpu_ops
from deepinfer.layers.attention import store_kv
from deepinfer.layers.cpu_ops import BF16_INPUT_ISAS, GEMM_ISAS, grouped_experts_bf16, linear_bf16
from deepinfer.layers.rotary import RotaryEmbedding

# Every kernel ISA this CPU runs, each with and without the batch-invariant reduction order.
MODES = [(isa, inv) for isa in GEMM_ISAS for inv in (False, True)]
# The kernels that read weights packed in bf16 pairs: the AVX2 tiles (every CPU here), and the engine's choice.
PACKED = [isa for isa in GEMM_ISAS if isa in ("avx2", cpu_ops.PACKED_ISA)]


def kernel_input(x: torch.Tensor, isa: str) -> torch.Tensor:
    """What the kernel of this ISA multiplies: x itself, or x rounded to bf16 for bf16 dot products."""
    return x.to(torch.bfloat16).float() if isa in BF16_INPUT_ISAS else x


# m covers the tile paths (1-9), the wide path's padded and whole 16-row groups with a tiled remainder
# (10-255, for n >= 256) and 256 rows; n not a multiple of the 6- or 12-row panels, k not of 8 or 16.
@pytest.mark.parametrize("isa, invariant", MODES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 10, 15, 16, 17, 26, 31, 33, 40, 64, 130, 256])
@pytest.mark.parametrize("k, n", [(64, 96), (100, 37), (1024, 20), (37, 259), (64, 300)])
def test_linear_bf16_matches_fp32_reference(m, k, n, isa, invariant):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    ref = F.linear(kernel_input(x, isa), w.float(), bias.float())
    out = linear_bf16(x, w, bias, isa=isa, invariant=invariant)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    xb = x.to(torch.bfloat16)  # bf16 in and out: one rounding of the fp32 result (to 1 bf16 step, 2^-7 relative)
    out_b = linear_bf16(xb, w, bias, isa=isa, invariant=invariant)
    ref_b = (F.linear(xb.float(), w.float()) + bias.float()).to(torch.bfloat16)
    assert out_b.dtype == torch.bfloat16
    torch.testing.assert_close(out_b.float(), ref_b.float(), rtol=2 ** -7, atol=1e-3)


# Big enough (N * K >= 2^20) to split columns over the thread pool; n = 1100 leaves a ragged last task.
@pytest.mark.parametrize("isa", list(GEMM_ISAS))
@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_threaded_linear_is_bit_identical_to_one_thread(m, isa, monkeypatch):
    """Columns are split, never the reduction, so every thread count gives the same bits; 50 calls
    back to back catch a worker that reads a finished job or misses a new one."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1024, generator=g)
    w = torch.randn(1100, 1024, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(platform, "kernel_threads", lambda: 1)
    ref = linear_bf16(x, w, isa=isa)
    torch.testing.assert_close(ref, F.linear(kernel_input(x, isa), w.float()), rtol=1e-5, atol=1e-3)
    for threads in (2, 3):
        monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
        for _ in range(50):
            assert torch.equal(linear_bf16(x, w, isa=isa), ref)


# fp32 weights (an fp32 model's linears) on the ISAs that read fp32 activations: rows of at most 2 KB (k 64, 100,
# 37) stream for up to 3 rows of x, k 600 goes to the tiles; the panel form from 10 rows at n >= 256.
@pytest.mark.parametrize("isa, invariant", [(isa, inv) for isa, inv in MODES if isa not in BF16_INPUT_ISAS])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 16, 17, 40, 130])
@pytest.mark.parametrize("k, n", [(64, 96), (100, 37), (37, 259), (600, 300)])
def test_linear_on_fp32_weights_matches_fp32_reference(m, k, n, isa, invariant, monkeypatch):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    monkeypatch.setattr(platform, "kernel_threads", lambda: 1)
    out = linear_bf16(x, w, bias, isa=isa, invariant=invariant)
    torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(platform, "kernel_threads", lambda: 2)
    assert torch.equal(linear_bf16(x, w, bias, isa=isa, invariant=invariant), out)
    if invariant:
        assert torch.equal(linear_bf16(x[m - 1:], w, bias, isa=isa, invariant=True), out[m - 1:])


# Rows past one pass of x (ROW_PASS_X_BYTES in csrc/cpu/gemm_bf16.cpp: 1 MB, 96-128 rows at K 2048) run in passes
# over the weights, each pass's columns split over the threads; 600 rows: 7 passes, the last of 24 rows (the
# panel form's last 16-row group and 8 rows of tiles), 250: 3 passes.
@pytest.mark.parametrize("isa, packed", [(isa, False) for isa in GEMM_ISAS] + [(isa, True) for isa in PACKED])
@pytest.mark.parametrize("m", [250, 600])
def test_linear_bf16_in_row_passes_matches_reference_on_any_thread_count(m, isa, packed, monkeypatch):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2048, generator=g)
    w = torch.randn(272, 2048, generator=g).to(torch.bfloat16)
    bias = torch.randn(272, generator=g).to(torch.bfloat16)
    wk = cpu_ops.pack_bf16_pairs(w) if packed else w
    monkeypatch.setattr(platform, "kernel_threads", lambda: 1)
    out = linear_bf16(x, wk, bias, isa=isa, packed=packed)
    torch.testing.assert_close(out, F.linear(kernel_input(x, isa), w.float(), bias.float()), rtol=1e-5, atol=2e-4)
    xb = x.to(torch.bfloat16)  # the rounding to bf16 runs on each finished block of the output
    out_b = linear_bf16(xb, wk, bias, isa=isa, packed=packed)
    ref_b = (F.linear(xb.float(), w.float()) + bias.float()).to(torch.bfloat16)
    torch.testing.assert_close(out_b.float(), ref_b.float(), rtol=2 ** -7, atol=1e-3)
    for threads in (2, 3):
        monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
        assert torch.equal(linear_bf16(x, wk, bias, isa=isa, packed=packed), out)
        assert torch.equal(linear_bf16(xb, wk, bias, isa=isa, packed=packed), out_b)


# Threads take whole experts: 2 splits the 4 active experts, 5 leaves threads without one.
@pytest.mark.parametrize("isa, invariant, packed", [(*mode, False) for mode in MODES] + [(isa, False, True) for isa in PACKED])
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("limit", [float("inf"), 0.7])
def test_grouped_experts_match_loop_reference(limit, threads, isa, invariant, packed, monkeypatch):
    monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
    g = torch.Generator().manual_seed(7)
    e, h, i = 6, 48, 24
    counts = torch.tensor([3, 0, 1, 5, 2, 0])
    x = torch.randn(int(counts.sum()), h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g).to(torch.bfloat16)
    w2 = torch.randn(e, h, i, generator=g).to(torch.bfloat16)
    pack = cpu_ops.pack_bf16_pairs if packed else (lambda w: w)
    out = grouped_experts_bf16(x, counts, pack(w13), pack(w2), limit, isa=isa, invariant=invariant, packed=packed)
    start, ref = 0, []
    for expert, c in enumerate(counts.tolist()):
        gate, up = F.linear(kernel_input(x[start:start + c], isa), w13[expert].float()).chunk(2, -1)
        act = kernel_input(F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit), isa)
        ref.append(F.linear(act, w2[expert].float()))
        start += c
    # bf16 inputs: an activation a hair from a rounding boundary may round the other way (one bf16 step).
    tol = dict(rtol=1e-2, atol=2e-2) if isa in BF16_INPUT_ISAS else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, torch.cat(ref), **tol)


# fp32 weights (an fp32 model's) on the ISAs that read fp32 activations. H 48: rows of up to 3 stream the weights
# (rows of at most 2 KB), K tails; H 530: every row count on tiles, and the down projection's 17 rows take one
# 16-row group of outer products (panels) and a tiled row.
@pytest.mark.parametrize("isa, invariant", [(isa, inv) for isa, inv in MODES if isa not in BF16_INPUT_ISAS])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("h, i", [(48, 24), (530, 40)])
def test_grouped_experts_on_fp32_weights_match_fp32_reference(h, i, threads, isa, invariant, monkeypatch):
    monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
    g = torch.Generator().manual_seed(h)
    counts = torch.tensor([3, 0, 1, 17, 2, 0])
    x = torch.randn(int(counts.sum()), h, generator=g)
    w13 = torch.randn(6, 2 * i, h, generator=g)
    w2 = torch.randn(6, h, i, generator=g)
    out = grouped_experts_bf16(x, counts, w13, w2, 0.7, isa=isa, invariant=invariant)
    start, ref = 0, []
    for expert, c in enumerate(counts.tolist()):
        gate, up = F.linear(x[start:start + c], w13[expert]).chunk(2, -1)
        ref.append(F.linear(F.silu(gate.clamp(max=0.7)) * up.clamp(-0.7, 0.7), w2[expert]))
        start += c
    torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-4)
    if invariant:  # expert 3's first row alone: the same bits as among its 17
        alone = grouped_experts_bf16(x[4:5], torch.tensor([0, 0, 0, 1, 0, 0]), w13, w2, 0.7, isa=isa, invariant=True)
        assert torch.equal(alone, out[4:5])


# fp32 weights run the ISAs that read fp32 activations.
@pytest.mark.parametrize("isa, invariant, weight_dtype", [(isa, inv, dt) for isa, inv in MODES
                                                          for dt in (torch.bfloat16, torch.float32)
                                                          if dt == torch.bfloat16 or isa not in BF16_INPUT_ISAS])
@pytest.mark.parametrize("m, n", [(0, 262), (3, 0), (0, 0)])
def test_linear_of_no_rows_or_no_outputs_is_empty(m, n, weight_dtype, isa, invariant, monkeypatch):
    """A step can ask for the logits of no rows: the kernel's row passes and column tasks divided by zero there
    (SIGFPE, the whole process down); now an empty result, on every ISA, with one thread or two."""
    x_dtype = torch.bfloat16 if isa in BF16_INPUT_ISAS else torch.float32
    for threads in (1, 2):
        monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
        y = linear_bf16(torch.randn(m, 64).to(x_dtype), torch.randn(n, 64).to(weight_dtype),
                        torch.randn(n).to(weight_dtype), isa=isa, invariant=invariant)
        assert y.shape == (m, n) and y.dtype == x_dtype


def test_fp32_weights_are_refused_where_no_kernel_reads_them():
    x, counts = torch.zeros(2, 32), torch.tensor([2])
    w13, w2 = torch.zeros(1, 32, 32), torch.zeros(1, 32, 16)
    with pytest.raises(ValueError, match="w2"):
        grouped_experts_bf16(x, counts, w13, w2.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        linear_bf16(x, w2[0].T.contiguous(), torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp32 weights"):
        grouped_experts_bf16(x, counts, w13, w2, isa="avx2", packed=True)
    with pytest.raises(ValueError, match="fp32 weights"):
        linear_bf16(x, w13[0], isa="avx2", packed=True)
    for isa in BF16_INPUT_ISAS & set(GEMM_ISAS):
        with pytest.raises(ValueError, match="fp32 weights"):
            grouped_experts_bf16(x, counts, w13, w2, isa=isa)
        with pytest.raises(ValueError, match="fp32 weights"):
            linear_bf16(x, w13[0], isa=isa)


def test_pack_bf16_pairs_lays_out_pairs_per_block_and_round_trips():
    """[N, K] -> [N/16][K/2][16][2]: the pair (w[n, 2j], w[n, 2j + 1]) of block b at [b][j][n % 16]; a stack of
    matrices packs as each alone; shapes the kernel cannot read are refused."""
    w = torch.arange(32 * 6, dtype=torch.float32).reshape(32, 6).to(torch.bfloat16)  # integers < 256: exact
    p = cpu_ops.pack_bf16_pairs(w)
    assert p.shape == w.shape and torch.equal(cpu_ops.pack_bf16_pairs(p, unpack=True), w)
    blocks = p.reshape(2, 3, 16, 2)
    assert torch.equal(blocks[1, 2, 5], w[16 + 5, 4:6]) and torch.equal(blocks[0, 0, 15], w[15, 0:2])
    stack = torch.randn(3, 48, 10).to(torch.bfloat16)
    assert torch.equal(cpu_ops.pack_bf16_pairs(stack)[2], cpu_ops.pack_bf16_pairs(stack[2]))
    # (2, 8, 6): 16 rows in all, but a block would span both matrices.
    for bad in (torch.zeros(24, 6), torch.zeros(32, 5), torch.zeros(2, 8, 6)):
        with pytest.raises(ValueError, match="multiple of 16"):
            cpu_ops.pack_bf16_pairs(bad.to(torch.bfloat16))


@pytest.fixture(params=[True, False], ids=["single-panel", "parallel-panels"])
def panel_order(request):
    """Packed GEMMs of up to 4 rows read one weight panel at a time, or several in parallel (the default depends
    on the machine's huge pages): both orders run here."""
    before = _C.set_single_panel_stream(request.param)
    yield request.param
    _C.set_single_panel_stream(before)


@pytest.mark.parametrize("isa", PACKED)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 40, 130])
@pytest.mark.parametrize("k, n", [(64, 96), (38, 272), (1024, 1104)])
def test_packed_linear_matches_reference_alone_in_a_batch_and_on_any_thread_count(m, k, n, isa, panel_order,
                                                                                  monkeypatch):
    """Packed weights: the fp32 reference on what the kernel multiplies (x, or x rounded to bf16); each row's bits
    are the same alone as in the batch (every tile sums its lanes in k order), on 1 or 2 threads (n 1104 splits
    over the pool), and whichever order the panels are read in."""
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    wp = cpu_ops.pack_bf16_pairs(w)
    monkeypatch.setattr(platform, "kernel_threads", lambda: 1)
    out = linear_bf16(x, wp, bias, isa=isa, packed=True)
    torch.testing.assert_close(out, F.linear(kernel_input(x, isa), w.float(), bias.float()), rtol=1e-5, atol=1e-4)
    for r in {0, m // 2, m - 1}:
        assert torch.equal(linear_bf16(x[r:r + 1], wp, bias, isa=isa, packed=True), out[r:r + 1]), r
    for threads in (2, 3):
        monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
        assert torch.equal(linear_bf16(x, wp, bias, isa=isa, packed=True), out)
    assert _C.single_panel_stream() == panel_order
    assert ("one panel at a time" in cpu_ops.packed_read_order()) == panel_order
    _C.set_single_panel_stream(not panel_order)
    assert torch.equal(linear_bf16(x, wp, bias, isa=isa, packed=True), out)


def test_packed_weights_are_refused_by_kernels_that_read_rows():
    w = torch.zeros(32, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot read packed weights"):
        linear_bf16(torch.zeros(2, 8), w, isa="avx2-panels", packed=True)


def test_expert_activation_at_extreme_gates_and_nan():
    """The vectorised SiLU's exp at gates far past its clamp (|g| ~ 1e3: exp under- and overflows) matches
    torch's; a NaN row stays NaN without touching the other rows."""
    g = torch.Generator().manual_seed(3)
    e, h, i = 2, 16, 27  # 27: three vector steps and a scalar tail
    counts = torch.tensor([3, 2])
    x = torch.randn(5, h, generator=g) * 200
    x[4] = float("nan")
    w13 = torch.randn(e, 2 * i, h, generator=g).to(torch.bfloat16)
    w2 = torch.randn(e, h, i, generator=g).to(torch.bfloat16)
    out = grouped_experts_bf16(x, counts, w13, w2)
    ref = []
    for expert, rows in ((0, x[:3]), (1, x[3:])):
        gate, up = F.linear(rows, w13[expert].float()).chunk(2, -1)
        ref.append(F.linear(F.silu(gate) * up, w2[expert].float()))
    ref = torch.cat(ref)
    assert out[4].isnan().all() and not out[:4].isnan().any()
    torch.testing.assert_close(out[:4], ref[:4], rtol=1e-4, atol=1e-2)


def test_bad_kernel_input_is_rejected_before_the_kernel():
    w = torch.randn(8, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="features"):
        linear_bf16(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="weight"):
        linear_bf16(torch.randn(2, 16), w.t())
    with pytest.raises(ValueError, match="expert shapes"):
        grouped_experts_bf16(torch.randn(3, 16), torch.tensor([1, 1]), torch.randn(2, 8, 16).to(torch.bfloat16),
                             torch.randn(2, 16, 5).to(torch.bfloat16))


def test_bf16_engine_logits_close_to_fp32_transformers(tiny_qwen3_moe):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20)
    ids = [5, 6, 7, 8, 9, 10]
    llm.engine.add_request("x", ids, __import__("deepinfer").SamplingParams(max_tokens=1))
    ours = llm.engine.runner.logits(llm.engine.scheduler.schedule())[0]
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32)(torch.tensor([ids])).logits[0, -1]
    assert (ours - ref).norm() / ref.norm() < 3e-2
    assert ours.argmax() == ref.argmax()


def test_threaded_mhc_and_decode_attention_are_bit_identical_to_one_thread(monkeypatch):
    """Shapes past the kernels' threading thresholds: tokens (mHC), sequences (V4 attention) and
    sequences, or with fewer sequences than threads (sequence, kv heads) parts (paged attention: one sequence's
    4 kv heads in 2 and 3 parts) are split over the pool, each computed as on one thread, so 2 and 3 threads
    give the same bits as 1."""
    from deepinfer.layers import cpu_ops

    g = torch.Generator().manual_seed(11)
    t, n, d = 130, 4, 512
    streams = torch.randn(t, n, d, generator=g)
    fn, base = torch.randn((2 + n) * n, n * d, generator=g) * 0.02, torch.randn((2 + n) * n, generator=g)
    scale = torch.tensor([0.5, 0.5, 0.5])
    block_out = torch.randn(t, d, generator=g)
    b, h, hd, w, k = 16, 16, 128, 130, 3
    q, ring, comp = torch.randn(b, h, hd, generator=g), torch.randn(b, w, hd, generator=g), torch.randn(b, k, hd, generator=g)
    ring_len, valid, sinks = torch.randint(0, w + 1, (b,), generator=g), torch.rand(b, k, generator=g) > 0.3, torch.randn(h)

    k_cache, v_cache = torch.randn(2, 64, 16, 4, hd, generator=g)
    tables, lens = torch.arange(64).view(16, 4), torch.randint(1, 65, (16,), generator=g)

    def run():
        post, comb, collapsed = cpu_ops.hc_pre(streams, fn, base, scale, 3, 1e-6, 1e-6)
        merged = cpu_ops.hc_merge(block_out, streams, post, comb)
        return (post, comb, collapsed, merged, cpu_ops.v4_decode_attention(q, ring, ring_len, comp, valid, sinks, 0.1),
                cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1),
                cpu_ops.paged_decode_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 0.1),
                cpu_ops.paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], torch.tensor([61]), 0.1),
                cpu_ops.paged_decode_attention(q[:1].bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables[:1],
                                               torch.tensor([61]), 0.1),
                cpu_ops.paged_decode_attention(q[:3].bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables[:3],
                                               lens[:3], 0.1))

    monkeypatch.setattr(platform, "kernel_threads", lambda: 1)
    ref = run()
    for threads in (2, 3):
        monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
        for ours, want in zip(run(), ref):
            assert torch.equal(ours, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d", [(16, 4, 64), (4, 4, 37), (6, 1, 128), (12, 2, 96)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_decode_attention_matches_a_per_sequence_softmax(dtype, heads, kv_heads, d, block_size):
    """Decode through the block tables (scattered block ids, -1 padding, contexts of 1 key, a block
    boundary and a full table) against softmax(q k^T * scale) v per sequence in fp64, on every path this
    CPU runs for the dtype (bf16 dot products: head_dim 64, 128, 96 = 64 + 32, query groups of 4, 1, 6 =
    4 + 2, chunks of 16 keys across blocks of 5); bf16 to one step of the single output rounding."""
    from deepinfer.layers.cpu_ops import decode_attention_isas, paged_decode_attention

    g = torch.Generator().manual_seed(heads + d)
    max_blocks = (80 + block_size - 1) // block_size
    lens = torch.tensor([1, 16, 17, 80, 33, 50, 15])
    k_cache = torch.randn(64, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(64, block_size, kv_heads, d, generator=g).to(dtype)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int64)
    ids = torch.randperm(64, generator=g)
    for b, n in enumerate(lens.tolist()):
        used = (n + block_size - 1) // block_size
        tables[b, :used], ids = ids[:used], ids[used:]
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    paths = decode_attention_isas(dtype, d)
    assert ("avx512bf16" in paths) == (dtype == torch.bfloat16 and d % 32 == 0 and "avx512bf16" in cpu_ops.GEMM_ISAS)
    for isa in paths:
        _check_paged_attention(paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, isa=isa),
                               q, k_cache, v_cache, tables, lens, block_size)


def _check_paged_attention(out, q, k_cache, v_cache, tables, lens, block_size):
    heads, kv_heads, d, dtype = q.shape[1], k_cache.shape[2], q.shape[2], q.dtype
    for b, n in enumerate(lens.tolist()):
        rows = tables[b, :(n + block_size - 1) // block_size]
        keys = k_cache[rows].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, 1)   # [n, H, D]
        values = v_cache[rows].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, 1)
        p = (torch.einsum("hd,nhd->hn", q[b].double(), keys) * d ** -0.5).softmax(-1)
        ref = torch.einsum("hn,nhd->hd", p, values)
        tol = dict(rtol=2 ** -7, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[b].double(), ref.to(dtype).double(), **tol)


def test_paged_decode_attention_refuses_a_path_that_does_not_run_the_inputs():
    from deepinfer.layers.cpu_ops import paged_decode_attention

    cache = torch.zeros(2, 16, 1, 64)
    with pytest.raises(ValueError, match="isa 'avx512bf16' does not run torch.float32"):
        paged_decode_attention(torch.zeros(1, 2, 64), cache, cache, torch.tensor([[0, 1]]), torch.tensor([3]), 1.0,
                               isa="avx512bf16")


def test_paged_decode_attention_rejects_contexts_outside_the_table():
    from deepinfer.layers.cpu_ops import paged_decode_attention

    cache = torch.zeros(4, 16, 2, 8)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(torch.zeros(1, 2, 8), cache, cache, torch.tensor([[0, 1]]), torch.tensor([33]), 1.0)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """deepinfer/layers/norm.py's torch form (transformers' RMSNorm)."""
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(1, 1024), (3, 37), (700, 128)])  # 700 x 128: split over threads
def test_rms_norm_matches_torch(rows, n, dtype, monkeypatch):
    monkeypatch.setattr(platform, "kernel_threads", lambda: 2)
    g = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    for weight in (w, None):
        out, ref = cpu_ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6)
        # bf16: the same bits; fp32: the sum of squares is accumulated in another order (last bit)
        tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, ref, **tol)
    strided = x[:, : n // 2]  # rows of a wider tensor, as q/k heads are views of the fused projection
    torch.testing.assert_close(cpu_ops.rms_norm(strided, w[: n // 2], 1e-6), torch_rms_norm(strided, w[: n // 2], 1e-6),
                               rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_matches_the_torch_layers(qk_norm, dtype):
    """The fused attention inputs against the torch modules they replace: RMSNorm per head, rotary,
    store_kv into scattered slots (slots not written stay untouched)."""
    g = torch.Generator().manual_seed(int(qk_norm))
    t, h, hkv, d = 9, 4, 2, 64
    rotary = RotaryEmbedding(d, 128, 10000.0)
    qkv = (torch.randn(t, (h + 2 * hkv) * d, generator=g) * 3).to(dtype)
    qw, kw = (torch.randn(d, generator=g).to(dtype) for _ in range(2)) if qk_norm else (None, None)
    positions = torch.randint(0, 128, (t,), generator=g)
    slots = torch.randperm(4 * 8, generator=g)[:t]
    k_cache, v_cache = torch.full((4, 8, hkv, d), 7.0, dtype=dtype), torch.full((4, 8, hkv, d), 7.0, dtype=dtype)
    q = cpu_ops.qk_norm_rope_store(qkv, h, hkv, d, qw, kw, 1e-6, rotary.cos, rotary.sin, positions, k_cache, v_cache,
                                   slots)
    q_ref, k_ref, v_ref = qkv.split([h * d, hkv * d, hkv * d], -1)
    q_ref, k_ref, v_ref = q_ref.reshape(t, h, d), k_ref.reshape(t, hkv, d), v_ref.reshape(t, hkv, d)
    if qk_norm:
        q_ref, k_ref = torch_rms_norm(q_ref, qw, 1e-6), torch_rms_norm(k_ref, kw, 1e-6)
    q_ref, k_ref = rotary(positions, q_ref, k_ref)
    k_exp, v_exp = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    store_kv(k_exp, v_exp, k_ref, v_ref, slots)
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 or not qk_norm else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k_cache, k_exp, **tol)
    assert torch.equal(v_cache, v_exp)
    with pytest.raises(IndexError, match="position"):
        cpu_ops.qk_norm_rope_store(qkv, h, hkv, d, qw, kw, 1e-6, rotary.cos, rotary.sin, positions + 128, k_cache,
                                   v_cache, slots)


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32)])
@pytest.mark.parametrize("t", [1, 6, 300])  # 300 tokens x 3: the gather and the sum split over threads
def test_moe_experts_match_grouped_loop(t, dtype, weight_dtype, monkeypatch):
    """The fused MoE call against grouping, expert by expert, and index_add_ in torch; a skipped expert
    contributes nothing. Expert weights in bf16, or fp32 (an fp32 model's)."""
    monkeypatch.setattr(platform, "kernel_threads", lambda: 2)
    g = torch.Generator().manual_seed(t)
    e, h, i, k = 6, 64, 40, 3
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g).to(dtype)
    w13 = torch.randn(e, 2 * i, h, generator=g).to(weight_dtype)
    w2 = torch.randn(e, h, i, generator=g).to(weight_dtype)
    skip = torch.zeros(e, dtype=torch.bool)
    skip[2] = True
    out = cpu_ops.moe_experts_bf16(x, ids, weights, w13, w2, 0.9, skip)
    ref = torch.zeros(t, h)
    for expert in range(e):
        token, slot = (ids == expert).nonzero(as_tuple=True)
        if expert == 2 or not len(token):
            continue
        gate, up = F.linear(x[token].float(), w13[expert].float()).chunk(2, -1)
        rows = F.linear(F.silu(gate.clamp(max=0.9)) * up.clamp(-0.9, 0.9), w2[expert].float())
        ref.index_add_(0, token, rows * weights[token, slot, None].float())
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="topk_ids"):
        cpu_ops.moe_experts_bf16(x, ids + e, weights, w13, w2)


def test_greedy_tokens_match_argmax_and_flag_non_finite_rows(monkeypatch):
    """torch.argmax's first-maximum rule (a row of ties gives 0, a repeated max its first index); a row with
    NaN, +inf or -inf gives -1; 70 x 32000 splits over threads."""
    monkeypatch.setattr(platform, "kernel_threads", lambda: 2)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(70, 32000, generator=g)
    logits[3, 5], logits[4, 7], logits[5, 9] = float("nan"), float("inf"), float("-inf")
    logits[6] = 1.0
    logits[8, 100] = logits[8, 200] = 50.0
    tokens = cpu_ops.greedy_tokens(logits)
    assert tokens[3:6].tolist() == [-1, -1, -1]
    keep = [i for i in range(70) if i not in (3, 4, 5)]
    assert torch.equal(tokens[keep], logits[keep].argmax(-1)) and tokens[6] == 0 and tokens[8] == 100
    assert cpu_ops.greedy_tokens(torch.empty(2, 0)).tolist() == [-1, -1]


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 37, 64])
def test_greedy_tokens_first_maximum_across_vector_lanes_and_the_tail(vocab):
    """The kernel keeps a running maximum per vector lane of 8: ties between lanes, within a lane, and
    with the scalar tail past the last whole vector all resolve to the first index, as torch.argmax does."""
    g = torch.Generator().manual_seed(vocab)
    rows = []
    for first, second in [(0, vocab - 1), (vocab // 2, vocab - 1), (vocab - 1, vocab - 1), (1, 9), (2, 10)]:
        row = torch.randn(vocab, generator=g)
        for i in (first, second):
            if i < vocab:
                row[i] = 9.0
        rows.append(row)
    rows.append(torch.full((vocab,), -3.0))
    logits = torch.stack(rows)
    assert torch.equal(cpu_ops.greedy_tokens(logits), logits.argmax(-1))


@pytest.mark.parametrize("vocab, n", [(32000, 5), (13, 13), (37, 0), (8, 1)])
def test_token_logprobs_match_log_softmax(monkeypatch, vocab, n):
    """log_softmax's values at the tokens and their ranks (1 + how many are more likely), and the n most likely in
    descending order, lower id first among equals (a three-way tie at the top here); a row whose token is -1 is left
    as zeros; 40 rows split over threads; n past the vocabulary is refused."""
    monkeypatch.setattr(platform, "kernel_threads", lambda: 2)
    g = torch.Generator().manual_seed(vocab + n)
    logits = torch.randn(40, vocab, generator=g) * 4
    logits[1, [vocab - 1, vocab // 2, 0]] = logits[1].max() + 1  # ties for the top, lanes and tail apart
    tokens = torch.randint(0, vocab, (40,), generator=g)
    tokens[2], tokens[3] = -1, logits[3].argmax()
    chosen, rank, top_ids, top_lp = cpu_ops.token_logprobs(logits, tokens, n)
    logp = logits.log_softmax(-1)
    keep = torch.arange(40) != 2
    want = logp.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    # Values against the exact log_softmax of these fp32 logits: torch's own fp32 one is ~7e-6 off at 32000 tokens
    # on AVX-512 CPUs (its sum order differs by ISA).
    exact = logits.double().log_softmax(-1)
    exact_chosen = exact.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    assert torch.allclose(chosen[keep].double(), exact_chosen[keep], atol=2e-6, rtol=0)
    assert torch.equal(rank[keep], (1 + (logp > want[:, None]).sum(-1))[keep]) and rank[3] == 1
    assert chosen[2] == 0 and rank[2] == 0 and (top_ids[2] == -1).all()
    order = sorted(range(vocab), key=lambda v: (-logits[1, v].item(), v))[:n]
    assert top_ids[1].tolist() == order
    by_value = logp.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(top_ids[keep], by_value.indices[keep, :n])
    assert torch.allclose(top_lp[keep].double(), exact.gather(1, by_value.indices[:, :n])[keep], atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="top logprobs"):
        cpu_ops.token_logprobs(logits, tokens, vocab + 1)


def test_sample_kernel_draws_the_reference_tokens():
    """cpu_ops.sample (the "sample" op on the CPU) against tilelang_ops' torch reference, token for token:
    60 seeds of the mixed case (greedy, top-k 1, ties, -inf rows, top-p with min-p), and a 49,152-token
    vocabulary under each filter alone, where the top-p search goes past its first 1024 candidates."""
    from test_tilelang_cases import sampling_case
    from tilelang_ops.sampling import sample_ref

    for seed in range(60):
        case = sampling_case(seed=seed)
        assert torch.equal(cpu_ops.sample(*case), sample_ref(*case)), seed
    g = torch.Generator().manual_seed(1)
    B, V = 8, 49152
    for top_k, top_p, min_p, spread in [(0, 1.0, 0.0, 4), (50, 1.0, 0.0, 4), (0, 0.9, 0.0, 4), (0, 0.99, 0.0, 0.5),
                                        (0, 1.0, 0.05, 4)]:
        logits = torch.randn(B, V, generator=g) * spread
        args = (torch.full((B,), 0.8), torch.full((B,), top_k, dtype=torch.int64), torch.full((B,), top_p),
                torch.full((B,), min_p), torch.randint(0, 2 ** 62, (B,), generator=g),
                torch.randint(0, 1000, (B,), generator=g))
        assert torch.equal(cpu_ops.sample(logits, *args), sample_ref(logits, *args)), (top_k, top_p, min_p)


@pytest.mark.parametrize("V", [1003, 32000])
def test_sample_kernel_draws_the_reference_tokens_where_its_shortcuts_are_tight(V):
    """The kernel scores tokens with vector logs and re-scores only those near the best, and finds thresholds in
    bins of z: rows made to stress both, against the reference token for token. Logits on the bins' 1/16 grid
    (ties at every bin edge and at the top-k / top-p thresholds), huge scores (an ulp above the Gumbel error),
    flat rows (every token a candidate), spreads past the last bin, and peaked rows."""
    from tilelang_ops.sampling import sample_ref

    g = torch.Generator().manual_seed(3)
    grid = torch.randint(-64, 1, (6, V), generator=g) / 16.0
    cases = [(grid, 1.0, k, p, m) for k, p, m in [(0, 1.0, 0), (10, 1.0, 0), (100, 1.0, 0), (0, 0.5, 0), (0, 0.9, 0),
                                                  (37, 0.7, 0), (0, 1.0, 0.3)]]
    cases += [(torch.randn(6, V, generator=g) * 1000, 0.05, k, p, 0) for k, p in [(0, 1.0), (5, 1.0), (0, 0.9)]]
    cases += [(torch.zeros(6, V), 1.0, k, p, 0) for k, p in [(0, 1.0), (7, 1.0), (0, 0.3)]]
    cases += [(torch.randn(6, V, generator=g) * 40, 1.0, k, p, 0) for k, p in [(0, 0.999999), (300, 1.0)]]
    cases += [(torch.randn(6, V, generator=g) * 10, 0.7, k, p, m) for k, p, m in [(50, 0.95, 0), (0, 0.95, 0.01)]]
    for logits, temperature, top_k, top_p, min_p in cases:
        B = logits.shape[0]
        args = (torch.full((B,), temperature), torch.full((B,), top_k, dtype=torch.int64),
                torch.full((B,), float(top_p)), torch.full((B,), float(min_p)),
                torch.randint(0, 2 ** 62, (B,), generator=g), torch.randint(0, 1000, (B,), generator=g))
        assert torch.equal(cpu_ops.sample(logits, *args), sample_ref(logits, *args)), (temperature, top_k, top_p)


def test_sample_kernel_vector_gumbel_noise_stays_within_its_bound():
    """The exactness of the draw rests on the vector Gumbel noise staying within GUMBEL_ERROR of the C library's
    (sampling.h): checked over all 2^23 uniforms, with room to spare for another libm."""
    assert _C.gumbel_approx_error() < _C.GUMBEL_ERROR / 4


@pytest.mark.parametrize("B, V", [(1, 1), (3, 31), (4, 32), (5, 33), (64, 1000)])
def test_apply_token_mask_equals_the_reference(B, V):
    """The dispatch point's CPU kernel against tilelang_ops' torch reference: random words, all-clear and
    all-set words (the kernel's two shortcuts), and the partial last word."""
    from tilelang_ops.dispatch import get_op
    from tilelang_ops.token_mask import apply_token_mask_ref

    g = torch.Generator().manual_seed(B * V)
    logits = torch.randn(B, V, generator=g)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, (V + 31) // 32), generator=g, dtype=torch.int32)
    mask[0, 0], mask[-1, -1] = 0, -1
    got = get_op("apply_token_mask")(logits.clone(), mask)
    assert torch.equal(got, apply_token_mask_ref(logits.clone(), mask))
    with pytest.raises(ValueError, match="bitmask must be"):
        cpu_ops.apply_token_mask(logits.clone(), mask[:, :0])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kv_load_is_the_reference_bit_for_bit(fmt, dtype, threads, monkeypatch):
    """Every nibble and scale byte (E4M3 subnormals, MXFP4's 2^-127 .. 2^127), padded indices and padded
    block-table entries: the C++ kv_load returns the torch reference's entries and valid mask exactly."""
    from tilelang_ops.kv_load import kv_load_ref

    monkeypatch.setattr(platform, "kernel_threads", lambda: threads)
    g = torch.Generator().manual_seed(3)
    blocks, per_block, D = 6, 8, 64
    packed = torch.randint(0, 256, (blocks, per_block, D // 2), dtype=torch.uint8, generator=g)
    group = 16 if fmt == "nvfp4" else 32
    scales = torch.randint(0, 255, (blocks, per_block, D // group), dtype=torch.uint8, generator=g)
    if fmt == "nvfp4":
        scales[scales & 0x7F == 0x7F] = 0x3F  # not E4M3's NaN pattern
    table = torch.tensor([[4, 0, 5, -1], [2, 3, 1, -1]])
    indices = torch.randint(-1, 3 * per_block, (2, 300), generator=g)
    got = cpu_ops.kv_load(packed, scales, table, indices, fmt, 0.75, dtype)
    want = kv_load_ref(packed, scales, table, indices, fmt, 0.75, dtype)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def kv_values(dtype: torch.dtype) -> torch.Tensor:
    """Rows over 12 decades with the formats' hard cases: zero rows, E2M1 midpoints, -0.0, an E4M3-subnormal
    NVFP4 scale, and one value per row at the row's maximum."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-6, 6, 40)[:, None]
    x[0] = 0.0
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, 0, -0.0, 1, 6])
    x[2] = -0.0
    x[3] *= 1e-4  # NVFP4 block scales amax / 6 below E4M3's normal range
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_and_load_rows_are_the_references_bit_for_bit(fmt, dtype):
    """store_rows / load_rows (csrc/cpu/kv_quant) write the bytes and return the values of the torch references
    (formats/fp8.py; tilelang_ops.kv_store / kv_load's references for FP4), into scattered pool rows."""
    from deepinfer.formats import fp4, fp8
    from tilelang_ops.kv_store import kv_store_ref

    x = kv_values(dtype)
    rows = torch.randperm(60, generator=torch.Generator().manual_seed(1))[:40]
    width, scale_shape = (64, (60, 1)) if fmt == "fp8" else (32, (60, 64 // (16 if fmt == "nvfp4" else 32)))
    scale_dtype = torch.float32 if fmt == "fp8" else torch.uint8
    data, scales = torch.zeros(60, width, dtype=torch.uint8), torch.zeros(scale_shape, dtype=scale_dtype)
    cpu_ops.store_rows(x, rows, data, scales, fmt, 1.0)
    if fmt == "fp8":
        want_q, want_s = fp8.quantize_fp8(x)
        assert torch.equal(data[rows], want_q) and torch.equal(scales[rows], want_s)
        want = fp8.dequantize_fp8(want_q, want_s, dtype)
    else:
        ref_data, ref_scales = torch.zeros_like(data)[:, None], torch.zeros_like(scales)[:, None]
        kv_store_ref(x, rows, ref_data, ref_scales, fmt)
        assert torch.equal(data, ref_data[:, 0]) and torch.equal(scales, ref_scales[:, 0])
        dequantize = fp4.dequantize_nvfp4 if fmt == "nvfp4" else fp4.dequantize_mxfp4
        want = dequantize(data[rows], scales[rows], dtype=dtype)
    got = cpu_ops.load_rows(data, scales, torch.cat([rows, torch.tensor([-1])]), fmt, dtype)
    assert torch.equal(got[:-1], want) and not got[-1].any()


def test_kv_rows_refuse_non_finite_values_and_bad_pools():
    data, scales = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1)
    x = torch.ones(2, 16)
    x[1, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        cpu_ops.store_rows(x, torch.tensor([0, 1]), data, scales, "fp8")
    assert not data.any() and not scales.any()  # nothing written
    with pytest.raises(ValueError, match=r"fp8 pool: .* must be contiguous CPU uint8"):
        cpu_ops.load_rows(data, torch.zeros(4, 2), torch.tensor([0]), "fp8", torch.float32)
    with pytest.raises(ValueError, match="fmt must be one of"):
        cpu_ops.load_rows(data, scales, torch.tensor([0]), "int4", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (7, 3, 64), (1, 16, 128)])
@pytest.mark.parametrize("inverse", [False, True])
def test_v4_rope_is_the_pairwise_rotation_bit_for_bit(dtype, shape, inverse):
    """apply_rope (C++ on the CPU) against the rotation written out per pair in fp32: (a, b) -> (a c - b s,
    b c + a s) on the trailing rd channels, one rounding to the dtype, the rest of the row untouched."""
    from deepinfer.layers.v4_attention import Rope, apply_rope

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    T, rd = shape[0], 32
    cos, sin = Rope(1.0 / 10000 ** (torch.arange(0, rd, 2).float() / rd), 1.3)(torch.arange(100, 100 + T), dtype)
    s = -sin if inverse else sin
    view = (T,) + (1,) * (len(shape) - 2) + (rd // 2,)
    a, b = x[..., -rd::2].float(), x[..., -rd + 1::2].float()
    c, s = cos[:, ::2].reshape(view), s[:, ::2].reshape(view)
    want = x.clone()
    want[..., -rd::2] = (a * c + (-b) * s).to(dtype)
    want[..., -rd + 1::2] = (b * c + a * s).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin, inverse), want)
