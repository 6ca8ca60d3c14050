"""Python boundary of the C++ CPU kernels in csrc/cpu: checks shapes and dtypes before handing raw
pointers over, so bad input raises here instead of corrupting memory."""
import contextlib

import torch

from deepinfer import _C, platform
from tilelang_ops.args import check_kv_load, check_kv_store, check_sample, check_v4_decode_attention, entry_slots

# Activation dtypes the kernels read and write directly.
STREAM_DTYPES = (torch.float32, torch.bfloat16)
# Weight dtypes the GEMM kernels read: bf16, and an fp32 model's fp32 (on the ISAs that read fp32 activations,
# row-major).
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
# Our GEMM kernels that run on this CPU, widest ISA first: {name: id} (gemm_kernels in csrc/cpu/kernels.cpp).
# A name is an ISA's dot-product tiles ("avx2"), or for the fp32 ISAs "<isa>-panels": the same kernel with
# 10+ rows on fp32 weight panels (outer products), which is faster on some CPUs and slower on others.
GEMM_ISAS = dict(reversed(_C.cpu_features()["gemm_isas"]))
# ISAs whose dot products take bf16 pairs: they round fp32 activations to bf16 first, as torch's bf16
# GEMM does (exact for bf16 activations). The others read activations in fp32.
BF16_INPUT_ISAS = {"avx512bf16", "amx"}
# The default ISA: the fastest that keeps fp32 activations exact.
EXACT_ISA = next(isa for isa in GEMM_ISAS if isa not in BF16_INPUT_ISAS)
# The ISA whose kernel reads weights packed in bf16 pairs (pack_bf16_pairs): AVX512-BF16's (bf16 pair products), else
# AVX2's, whose packed tiles widen each pair to fp32 (activations stay fp32). Whether a weight is packed is measured
# per shape at engine start (gemm_plan packs_linear / packs_experts): on AVX2 and AVX512-BF16 CPUs packing ran
# 1.3-1.4x faster; beside AMX tiles, which read row-major weights, it was never measured before.
PACKED_ISA = "avx512bf16" if "avx512bf16" in GEMM_ISAS else "avx2" if "avx2" in GEMM_ISAS else None
PAIR_BLOCK = _C.PAIR_BLOCK  # output rows per packed panel


def _check(t: torch.Tensor, name: str, dtype: torch.dtype | tuple, dims: int) -> None:
    if t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)) or t.dim() != dims or not t.is_contiguous() \
            or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor with {dims} dims, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check_vector(t: torch.Tensor | None, name: str, dtype: torch.dtype | tuple, n: int) -> None:
    """t: a contiguous CPU [n] tensor of dtype, or None (an absent optional one)."""
    if t is not None:
        _check(t, name, dtype, 1)
        if t.shape != (n,):
            raise ValueError(f"{name}: expected [{n}], got {tuple(t.shape)}")


def _check_experts(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Expert weights w13 [E, 2I, H], w2 [E, H, I]: contiguous, 3 dims, both of one of WEIGHT_DTYPES."""
    _check(w13, "w13", WEIGHT_DTYPES, 3)
    _check(w2, f"w2 (as w13, {w13.dtype})", w13.dtype, 3)


def _check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, d: int) -> None:
    for name, table in (("cos", cos), ("sin", sin)):
        _check(table, name, torch.float32, 2)
        if table.shape[1] != d:
            raise ValueError(f"{name}: expected [positions, {d}], got {tuple(table.shape)}")


def _ptr(t: torch.Tensor | None) -> int:
    """The data pointer the kernels take, 0 for an absent optional tensor."""
    return 0 if t is None else t.data_ptr()


def _isa_id(isa: str | None) -> int:
    if isa is None:
        return GEMM_ISAS[EXACT_ISA]
    if isa not in GEMM_ISAS:
        raise ValueError(f"GEMM isa {isa!r} does not run on this CPU; available: {list(GEMM_ISAS)}")
    return GEMM_ISAS[isa]


def can_pack(*weights: torch.Tensor) -> bool:
    """Whether these bf16 weights [..., N, K] can be packed here: a PACKED_ISA, N a multiple of PAIR_BLOCK, K even."""
    return PACKED_ISA is not None and all(
        w.dtype == torch.bfloat16 and w.shape[-2] % PAIR_BLOCK == 0 and w.shape[-1] % 2 == 0 for w in weights)


def pack_bf16_pairs(w: torch.Tensor, unpack: bool = False) -> torch.Tensor:
    """w [..., N, K] bf16 -> the same shape holding each matrix as [N/16][K/2][16][2]: per 16 outputs, each pair
    of k's weights side by side (what the kernels read with packed=True); unpack: the inverse."""
    _check(w, "w", torch.bfloat16, w.dim())
    if w.dim() < 2 or w.shape[-2] % PAIR_BLOCK or w.shape[-1] % 2:
        raise ValueError(f"pack_bf16_pairs: w must be [..., N, K] with N a multiple of {PAIR_BLOCK} and K even, "
                         f"got {tuple(w.shape)}")
    k = w.shape[-1]
    out = torch.empty_like(w)
    _C.pack_bf16_pairs(w.data_ptr(), out.data_ptr(), w.numel() // k, k, unpack)  # N % 16 == 0: blocks stay in a matrix
    return out


def packed_read_order() -> str | None:
    """How the packed kernel reads weights for few rows of x (csrc/cpu/gemm_kernel.h, pair_rows), for logs and
    reports; None where this CPU has no packed kernel."""
    if PACKED_ISA is None:
        return None
    order = "one panel at a time (2 MiB pages)" if _C.single_panel_stream() \
        else "panels in parallel, software-prefetched (4 KiB pages, or a CPU without AVX-512)"
    return f"packed weights ({PACKED_ISA}), up to 4 rows: {order}"


@contextlib.contextmanager
def scratch_kept():
    """Inside the block (or a function it decorates) the kernels' scratch buffers keep their pages whatever their
    size (csrc/cpu/scratch.h): a prefill step's layers reuse one set instead of faulting a fresh one in each."""
    _C.keep_scratch(True)
    try:
        yield
    finally:
        _C.keep_scratch(False)


def row_major(w: torch.Tensor, packed: bool) -> torch.Tensor:
    """w [..., N, K] as row-major weights: unpacked (a copy) when packed, else w itself."""
    return pack_bf16_pairs(w, unpack=True) if packed else w


def pack_in_place(*weights: torch.Tensor) -> None:
    """pack_bf16_pairs into each weight's own storage (shape, storage and any views of whole matrices stay)."""
    for w in weights:
        w.copy_(pack_bf16_pairs(w))


def linear_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None,
                invariant: bool = False, packed: bool = False) -> torch.Tensor:
    """x [..., K] fp32 or bf16; w [N, K] bf16, or fp32 (an fp32 model's: isa one that reads fp32 activations);
    bias [N] of w's dtype or None -> [..., N] in x.dtype (fp32 accumulation, one rounding to x.dtype). isa: a key
    of GEMM_ISAS (None: EXACT_ISA); invariant: the same reduction order for every M (batch-invariant results);
    packed: w is pack_bf16_pairs(...) (isa PACKED_ISA)."""
    _check(w, "weight", WEIGHT_DTYPES, 2)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {k}")
    if x.dtype not in STREAM_DTYPES:
        raise ValueError(f"input dtype {x.dtype}: the kernel reads {STREAM_DTYPES}")
    _check_vector(bias, "bias (one per weight output)", w.dtype, n)
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype)
    _C.linear_bf16(x2.data_ptr(), w.data_ptr(), _ptr(bias), w.dtype == torch.float32, out.data_ptr(),
                   x.dtype == torch.bfloat16, x2.shape[0], k, n, _isa_id(isa), invariant, packed,
                   platform.kernel_threads())
    return out.reshape(*x.shape[:-1], n)


def grouped_experts_bf16(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         limit: float = float("inf"), skip: torch.Tensor | None = None, isa: str | None = None,
                         invariant: bool = False, packed: bool = False) -> torch.Tensor:
    """x [S, H] fp32 rows sorted by expert; counts [E] rows per expert; w13 [E, 2I, H] (gate rows, then up) and
    w2 [E, H, I], both bf16 or both fp32 (WEIGHT_DTYPES) -> [S, H] fp32, each row through its expert's SwiGLU with
    gate <= limit and |up| <= limit (swiglu_limit; inf: none). skip [E] bool: experts whose rows the
    caller computes (their rows are left unwritten). isa, invariant, packed: as linear_bf16 (a BF16_INPUT_ISAS
    kernel rounds x and the SwiGLU output to bf16 before each GEMM, as torch's bf16 experts do; fp32 weights take
    the other ISAs, row-major)."""
    _check(x, "x", torch.float32, 2)
    _check_experts(w13, w2)
    e, two_i, h = w13.shape
    if w2.shape != (e, h, two_i // 2) or x.shape[1] != h or counts.shape != (e,) or int(counts.sum()) != x.shape[0]:
        raise ValueError(f"expert shapes disagree: x {tuple(x.shape)}, counts {tuple(counts.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if skip is not None and skip.shape != (e,):
        raise ValueError(f"skip: expected one flag per expert ({e}), got {tuple(skip.shape)}")
    offsets = torch.zeros(e + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    skip8 = None if skip is None else skip.to(torch.uint8).contiguous()
    y = torch.empty_like(x)
    _C.grouped_experts_bf16(x.data_ptr(), offsets.data_ptr(), e, _ptr(skip8), w13.data_ptr(), w2.data_ptr(),
                            w13.dtype == torch.float32, y.data_ptr(), h, two_i // 2, float(limit), _isa_id(isa),
                            invariant, packed, platform.kernel_threads())
    return y


def moe_experts_bf16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, limit: float = float("inf"), skip: torch.Tensor | None = None,
                     isa: str | None = None, invariant: bool = False, packed: bool = False) -> torch.Tensor:
    """x [T, H]; topk_ids [T, k] expert ids; topk_weights [T, k] in x.dtype (fp32 or bf16); w13 [E, 2I, H], w2
    [E, H, I] as grouped_experts_bf16's -> [T, H] fp32: sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]),
    SwiGLU clamped at limit. skip [E] bool: experts the caller adds itself. isa, invariant, packed: as
    grouped_experts_bf16."""
    _check(x, "x", STREAM_DTYPES, 2)
    _check_experts(w13, w2)
    t, h = x.shape
    e, two_i, _ = w13.shape
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(x.dtype).contiguous()
    if w13.shape[2] != h or w2.shape != (e, h, two_i // 2) or ids.dim() != 2 or ids.shape[0] != t \
            or weights.shape != ids.shape:
        raise ValueError(f"moe shapes disagree: x {tuple(x.shape)}, topk_ids {tuple(ids.shape)}, topk_weights "
                         f"{tuple(weights.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if skip is not None and skip.shape != (e,):
        raise ValueError(f"skip: expected one flag per expert ({e}), got {tuple(skip.shape)}")
    skip8 = None if skip is None else skip.to(torch.uint8).contiguous()
    y = torch.empty(t, h)
    _C.moe_experts_bf16(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), x.dtype == torch.bfloat16, t, ids.shape[1],
                        e, _ptr(skip8), w13.data_ptr(), w2.data_ptr(), w13.dtype == torch.float32, y.data_ptr(), h,
                        two_i // 2, float(limit), _isa_id(isa), invariant, packed, platform.kernel_threads())
    return y


def attention_block_weights(norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor, qkv_bias: torch.Tensor | None,
                            qkv_isa: str, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_eps: float,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            o_w: torch.Tensor, o_bias: torch.Tensor | None, o_isa: str, num_heads: int, scale: float,
                            invariant: bool = False, qkv_packed: bool = False, o_packed: bool = False) -> tuple:
    """Checks a decoder layer's attention weights once and returns them as attention_block's `weights`: norm_w
    [hidden]; qkv_w [(H + 2 Hkv) D, hidden], o_w [hidden, H D] both bf16 or both fp32 (WEIGHT_DTYPES; biases of
    their dtype or None; qkv_packed / o_packed: the weight is pack_bf16_pairs(...)) on qkv_isa / o_isa
    (keys of GEMM_ISAS); q_norm, k_norm [D] or None; cos, sin [positions, D] fp32; k_cache, v_cache [blocks,
    block_size, Hkv, D]. Norm weights and caches share the activations' dtype (fp32/bf16). The tensors must
    outlive every call that is given the result."""
    _check(k_cache, "k_cache", STREAM_DTYPES, 4)
    _check(v_cache, "v_cache", k_cache.dtype, 4)
    dtype = k_cache.dtype
    blocks, block_size, hkv, d = k_cache.shape
    h, hidden = num_heads, norm_w.shape[0]
    for name, w, n in (("norm_w", norm_w, hidden), ("q_norm", q_norm, d), ("k_norm", k_norm, d)):
        _check_vector(w, name, dtype, n)
    _check(qkv_w, "qkv weight", WEIGHT_DTYPES, 2)
    for name, w, b, shape in (("qkv", qkv_w, qkv_bias, ((h + 2 * hkv) * d, hidden)), ("o", o_w, o_bias, (hidden, h * d))):
        _check(w, f"{name} weight (as qkv's)", qkv_w.dtype, 2)
        if w.shape != shape:
            raise ValueError(f"{name}: expected weight {shape}, got {tuple(w.shape)}")
        _check_vector(b, f"{name} bias", qkv_w.dtype, shape[0])
    _check_rope_tables(cos, sin, d)
    if v_cache.shape != k_cache.shape or h % hkv or d % 2:
        raise ValueError(f"attention_block: {h} heads over caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    return dtype, hidden, _C.AttentionBlock(hidden, h, hkv, d, norm_w.data_ptr(), float(eps), qkv_w.data_ptr(),
                                            _ptr(qkv_bias), _isa_id(qkv_isa), _ptr(q_norm), _ptr(k_norm), float(qk_eps),
                                            cos.data_ptr(), sin.data_ptr(), cos.shape[0], k_cache.data_ptr(),
                                            v_cache.data_ptr(), blocks, block_size, o_w.data_ptr(), _ptr(o_bias),
                                            _isa_id(o_isa), float(scale), invariant, qkv_packed, o_packed,
                                            qkv_w.dtype == torch.float32)


def attention_block(x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, weights: tuple) -> torch.Tensor:
    """A decoder layer's attention half at decode, one query per sequence: x [T, hidden] -> o_proj(attention(
    rope(qk_norm(qkv_proj(rms_norm(x)))))) [T, hidden], storing each token's key and value at slot_mapping [T];
    block_tables [T, max_blocks], context_lens [T], positions [T]. weights: attention_block_weights(...). See
    csrc/cpu/attention_block.h."""
    dtype, hidden, block = weights
    held, args = _decode_inputs("attention_block", x, dtype, hidden, positions, slot_mapping, block_tables, context_lens)
    out = torch.empty_like(x)
    _C.attention_block(x.data_ptr(), out.data_ptr(), *args, platform.kernel_threads(), block)
    return out


def _decode_inputs(name: str, x: torch.Tensor, dtype: torch.dtype, hidden: int, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple:
    """Checks a decode step's inputs for the fused layer kernels -> (the int64 tensors the pointers point into, to
    be held for the call; the arguments (T, bf16, positions, slots, block_tables, max_blocks, context_lens))."""
    _check(x, "x", dtype, 2)
    if x.shape[1] != hidden:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [T, {hidden}]")
    return _step_inputs(name, x.shape[0], dtype, positions, slot_mapping, block_tables, context_lens)


def _step_inputs(name: str, t: int, dtype: torch.dtype, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple:
    """_decode_inputs for a step of t tokens."""
    pos, slots, lens = (v.to(torch.int64).contiguous() for v in (positions, slot_mapping, context_lens))
    tables = block_tables.to(torch.int64).contiguous()
    if pos.shape != (t,) or slots.shape != (t,) or lens.shape != (t,) or tables.dim() != 2 or tables.shape[0] != t:
        raise ValueError(f"{name}: {t} tokens, positions {tuple(pos.shape)}, slot_mapping {tuple(slots.shape)}, "
                         f"context_lens {tuple(lens.shape)}, block_tables {tuple(tables.shape)}")
    return (pos, slots, tables, lens), (t, dtype == torch.bfloat16, pos.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                        tables.shape[1], lens.data_ptr())


def moe_block_weights(norm_w: torch.Tensor, eps: float, gate: torch.Tensor, top_k: int, renorm: bool,
                      w13: torch.Tensor, w2: torch.Tensor, gate_isa: str, expert_isas: list[str],
                      invariant: bool = False, packed: bool = False, gate_packed: bool = False) -> tuple:
    """Checks a Qwen3-MoE layer's second-half weights once and returns them as moe_block's `weights`: norm_w [H]
    (the activations' dtype, fp32/bf16); the softmax top_k router gate [E_logical, H] (renormalised when renorm) on
    gate_isa; experts w13 [E, 2I, H], w2 [E, H, I]; gate and experts all bf16 or all fp32 (WEIGHT_DTYPES);
    expert_isas[i]: the grouped kernel's ISA
    when the busiest expert has 2^i.. rows (ISAs: keys of GEMM_ISAS); packed, gate_packed: the experts, the router
    are pack_bf16_pairs(...). The tensors must outlive the result's use."""
    _check(norm_w, "norm_w", STREAM_DTYPES, 1)
    _check_experts(w13, w2)
    _check(gate, f"gate (as w13, {w13.dtype})", w13.dtype, 2)
    h = norm_w.shape[0]
    e, two_i, _ = w13.shape
    if gate.shape[1] != h or w13.shape[2] != h or w2.shape != (e, h, two_i // 2) or not 0 < top_k <= gate.shape[0] \
            or not expert_isas:
        raise ValueError(f"moe_block shapes disagree: norm_w {tuple(norm_w.shape)}, gate {tuple(gate.shape)}, top_k "
                         f"{top_k}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, {len(expert_isas)} expert ISAs")
    return norm_w.dtype, h, gate.shape[0], _C.MoeBlock(h, two_i // 2, norm_w.data_ptr(), float(eps), gate.data_ptr(),
                                                      gate.shape[0], top_k, renorm, _isa_id(gate_isa), e, w13.data_ptr(),
                                                      w2.data_ptr(), [_isa_id(i) for i in expert_isas], invariant,
                                                      packed, gate_packed, w13.dtype == torch.float32)


def moe_block(x: torch.Tensor, a: torch.Tensor, weights: tuple, counts: torch.Tensor | None = None,
              log2phy: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3-MoE's second half-layer: x, a [T, H] -> x1 + moe(rms_norm(x1)), x1 = x + a. weights:
    moe_block_weights(...). counts [E_logical] int64: expert load to add to (or None); log2phy [E_logical] int64:
    physical slot of each logical expert (None: the identity). See csrc/cpu/moe_block.h."""
    dtype, h, _, block = weights
    _check(x, "x", dtype, 2)
    _check(a, "a", dtype, 2)
    if x.shape[1] != h or a.shape != x.shape:
        raise ValueError(f"moe_block: x {tuple(x.shape)} and a {tuple(a.shape)} must be [T, {h}]")
    out = torch.empty_like(x)
    _C.moe_block(x.data_ptr(), a.data_ptr(), out.data_ptr(), x.shape[0], dtype == torch.bfloat16,
                 *_load_pointers(weights, counts, log2phy), platform.kernel_threads(), block)
    return out


def _load_pointers(moe_weights: tuple, counts: torch.Tensor | None, log2phy: torch.Tensor | None) -> tuple[int, int]:
    """Checks a MoE half's counts and log2phy (one per logical expert, or None) -> their pointers."""
    e_logical = moe_weights[2]
    _check_vector(counts, "counts", torch.int64, e_logical)
    _check_vector(log2phy, "log2phy", torch.int64, e_logical)
    return _ptr(counts), _ptr(log2phy)


def decode_head_weights(norm_w: torch.Tensor, eps: float, lm_head: torch.Tensor, isa: str, invariant: bool = False,
                        packed: bool = False) -> tuple:
    """Checks a model's final RMSNorm and LM head once and returns them as decoder_stack's `head`: norm_w [hidden]
    (the activations' dtype, fp32/bf16); lm_head [vocab, hidden] bf16 or fp32 on isa (a key of GEMM_ISAS; packed:
    it is pack_bf16_pairs(...)). The tensors must outlive the result's use."""
    _check(norm_w, "norm_w", STREAM_DTYPES, 1)
    _check(lm_head, "lm_head", WEIGHT_DTYPES, 2)
    if lm_head.shape[1] != norm_w.shape[0]:
        raise ValueError(f"decode head: lm_head {tuple(lm_head.shape)} does not take norm_w {tuple(norm_w.shape)}")
    return norm_w.dtype, norm_w.shape[0], lm_head.shape[0], _C.DecodeHead(
        norm_w.data_ptr(), float(eps), lm_head.data_ptr(), lm_head.shape[0], _isa_id(isa), invariant, packed,
        lm_head.dtype == torch.float32)


def decoder_stack(embed: torch.Tensor, layers: list[tuple], head: tuple | None = None) -> tuple:
    """Checks a model's decode-time weights once and returns them as decode_step's `stack`: embed [vocab, hidden]
    (the activations' dtype) for the step's token ids; layers: per layer (attention_block_weights(...),
    moe_block_weights(...), log2phy) with log2phy as moe_block's; head: decode_head_weights(...) or None. The
    tensors must outlive the result's use."""
    if not layers:
        raise ValueError("decoder_stack: no layers")
    dtype, hidden = layers[0][0][:2]
    if any(attn[:2] != (dtype, hidden) or moe[:2] != (dtype, hidden) for attn, moe, _ in layers) \
            or (head is not None and head[:2] != (dtype, hidden)):
        raise ValueError("decoder_stack: every layer's halves and the head must share one activation dtype and "
                         "hidden size")
    _check(embed, "embed", dtype, 2)
    if embed.shape[1] != hidden:
        raise ValueError(f"decoder_stack: embed {tuple(embed.shape)} must be [vocab, {hidden}]")
    for _, moe, log2phy in layers:
        _check_vector(log2phy, "log2phy", torch.int64, moe[2])
    num_counts = sum(moe[2] for _, moe, _ in layers)
    return dtype, hidden, None if head is None else head[2], num_counts, _C.DecoderStack(
        embed.data_ptr(), embed.shape[0], [attn[2] for attn, _, _ in layers], [moe[3] for _, moe, _ in layers],
        [_ptr(log2phy) for _, _, log2phy in layers], None if head is None else head[3])


def decode_step(stack: tuple, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step in one call: input_ids [T] int64 -> the stack's last layer's output [T, hidden] over
    embed[input_ids], or with a head the fp32 logits [T, vocab] of its LM head over its norm of that. The other
    inputs as attention_block's; counts [sum of the layers' E_logical] int64: every layer's expert-load counters
    in layer order, added to (or None). See csrc/cpu/decode_step.h."""
    dtype, hidden, vocab, num_counts, weights = stack
    _check(input_ids, "input_ids", torch.int64, 1)
    _check_vector(counts, "counts", torch.int64, num_counts)
    t = input_ids.shape[0]
    held, (_, bf16, *args) = _step_inputs("decode_step", t, dtype, positions, slot_mapping, block_tables, context_lens)
    out = torch.empty(t, hidden, dtype=dtype)
    logits = None if vocab is None else torch.empty(t, vocab, dtype=torch.float32)
    _C.decode_step(weights, input_ids.data_ptr(), _ptr(counts), out.data_ptr(), _ptr(logits), t, bf16, *args,
                   platform.kernel_threads())
    return out if logits is None else logits


def decode_drawn(stack: tuple, batch, sampling: tuple | None = None, counts: torch.Tensor | None = None,
                 num_logprobs: int = -1) -> tuple[torch.Tensor, tuple | None]:
    """decode_step over a scheduled decode batch (a C++ ScheduledBatch of one token per sequence) read from its own
    arrays, with the stack's head, and each row's token [T] int64 drawn from its logits: the first argmax, or with
    sampling (per row, lists: temperature, top_k, top_p, min_p, seeds, offsets) sample()'s draw; -1 for a row with
    NaN or inf. Building decode_step's tensors from the batch costs ~0.3 ms of a batch-1 step's Python (on caches
    the weight stream has just emptied), the Python sampler's ~0.7 ms more; this builds none. counts as
    decode_step's. -> (tokens, None), or with num_logprobs >= 0 (tokens, token_logprobs' four tensors) of the raw
    logits at the drawn tokens, num_logprobs top ones per row."""
    dtype, _, vocab, num_counts, weights = stack
    _check_vector(counts, "counts", torch.int64, num_counts)
    tokens, logprobs = _C.decode_drawn(weights, batch, sampling, _ptr(counts), dtype == torch.bfloat16,
                                       platform.kernel_threads(), num_logprobs)
    return torch.from_numpy(tokens), step_logprobs(logprobs)


def step_logprobs(arrays: tuple | None) -> tuple | None:
    """A drawn step's logprobs from C++ (numpy arrays, or None) as tensors: (token_logprob [T], rank [T], top_ids
    [T, n], top_logprobs [T, n])."""
    return None if arrays is None else tuple(torch.from_numpy(a) for a in arrays)


def decode_steps(stack: tuple, scheduler, batch, max_steps: int, sampling: tuple | None, counts: torch.Tensor | None,
                 done: list, num_logprobs: int = -1) -> list:
    """decode_drawn over `batch` (a decode ScheduledBatch of `scheduler`) and up to max_steps - 1 more decode
    steps, each scheduled and processed by the scheduler in C++ while no sequence waits or is mid-prefill; appends
    (batch, scheduler.process outputs, logprobs: None or numpy arrays, step_logprobs' input) per step to done, also
    when a later step raises.
    sampling and num_logprobs: decode_drawn's,
    per sequence of `batch` in its row order; each row drawn at its offset + the steps it ran in this call.
    counts [max_steps, sum of the layers' E_logical] int64: row k added to by step k (or None). Returns the
    sequences a last decode schedule evicted without running (see csrc/engine/decode_loop.h)."""
    dtype, _, _, num_counts, weights = stack
    if counts is not None:
        _check(counts, "counts", torch.int64, 2)
        if counts.shape != (max_steps, num_counts):
            raise ValueError(f"counts: expected [{max_steps}, {num_counts}], got {tuple(counts.shape)}")
    return _C.decode_steps(weights, scheduler, batch, max_steps, sampling, num_logprobs, _ptr(counts), num_counts,
                           dtype == torch.bfloat16, platform.kernel_threads(), done)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """logits [B, V] fp32, tokens [B] int64 (>= 0; a row with -1 gets logprob 0 and rank 0), n top logprobs (0..V)
    -> (token_logprob [B] fp32, rank [B] int64, top_ids [B, n] int64, top_logprobs [B, n] fp32): log_softmax's values
    at the tokens, 1 + how many tokens are more likely, and the n most likely, descending (lower id first among
    equals)."""
    _check(logits, "logits", torch.float32, 2)
    b, v = logits.shape
    _check_vector(tokens, "tokens", torch.int64, b)
    if not 0 <= n <= v:
        raise ValueError(f"n: top logprobs must be 0..{v} (the vocabulary), got {n}")
    out = (torch.zeros(b), torch.zeros(b, dtype=torch.int64), torch.full((b, n), -1, dtype=torch.int64),
           torch.zeros(b, n))
    _C.token_logprobs(logits.data_ptr(), b, v, tokens.data_ptr(), n, *(t.data_ptr() for t in out),
                      platform.kernel_threads())
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 -> [B] int64: each row's first argmax, or -1 for a row with NaN or inf."""
    _check(logits, "logits", torch.float32, 2)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[1] == 0:
        return tokens.fill_(-1)
    _C.greedy_tokens(logits.data_ptr(), logits.shape[0], logits.shape[1], tokens.data_ptr(), platform.kernel_threads())
    return tokens


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    """tilelang_ops.sampling.sample_ref's arguments and draw (bit-identical hashes; C-library logs, so scores
    tied within an ulp could break differently), in C++: [B, V] logits -> [B] int64 tokens."""
    check_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    B, V = logits.shape
    args = [t.contiguous() for t in (logits.float(), temperature, top_k.long(), top_p, min_p, seeds, offsets)]
    tokens = torch.empty(B, dtype=torch.int64)
    _C.sample_tokens(args[0].data_ptr(), B, V, *(t.data_ptr() for t in args[1:]), tokens.data_ptr(),
                     platform.kernel_threads())
    return tokens


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """tilelang_ops.token_mask.apply_token_mask_ref's arguments and result: logits [B, V] fp32 set to -inf in
    place where bitmask [B, ceil(V/32)] int32 clears the token's bit; returns logits."""
    _check(logits, "logits", torch.float32, 2)
    _check(bitmask, "bitmask", torch.int32, 2)
    B, V = logits.shape
    if bitmask.shape != (B, (V + 31) // 32):
        raise ValueError(f"apply_token_mask: bitmask must be [{B}, {(V + 31) // 32}] for logits [{B}, {V}], "
                         f"got {tuple(bitmask.shape)}")
    _C.apply_token_mask(logits.data_ptr(), bitmask.data_ptr(), B, V, platform.kernel_threads())
    return logits


KV_FORMATS = {"fp8": 0, "nvfp4": 1, "mxfp4": 2}  # csrc/cpu/kv_quant.h's KvFormat


def load_rows(data: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, fmt: str, dtype: torch.dtype,
              tensor_scale: float = 1.0) -> torch.Tensor:
    """Pool rows [...] (flat indices into data's leading dims; < 0: zeros) of a quantised pool -> [..., D] in
    dtype, the torch references' values bit for bit. data [..., D] uint8 E4M3 with scales [..., 1] fp32 ('fp8'),
    or [..., D/2] packed with scales [..., D/16 | D/32] uint8 ('nvfp4' | 'mxfp4'); see csrc/cpu/kv_quant.h."""
    D = _kv_width(data, scales, fmt)
    if dtype not in STREAM_DTYPES:
        raise ValueError(f"load_rows: output dtype {dtype} must be one of {STREAM_DTYPES}")
    flat = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(*rows.shape, D, dtype=dtype)
    _C.kv_load_rows(data.data_ptr(), scales.data_ptr(), flat.data_ptr(), flat.numel(), D, KV_FORMATS[fmt],
                    float(tensor_scale), out.data_ptr(), dtype == torch.bfloat16, platform.kernel_threads())
    return out


def store_rows(values: torch.Tensor, rows: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fmt: str,
               tensor_scale: float = 1.0) -> None:
    """Pool rows [N] = values [N, D] quantised (load_rows' layouts), as the torch references round. Non-finite
    values raise ValueError and write nothing."""
    D = _kv_width(data, scales, fmt)
    if values.dim() != 2 or values.shape[1] != D or rows.shape != (values.shape[0],) or not fast_path(values):
        raise ValueError(f"store_rows: values {values.dtype} {tuple(values.shape)} on {values.device} must be [N, {D}] "
                         f"of {STREAM_DTYPES} for rows {tuple(rows.shape)}")
    x, flat = values.contiguous(), rows.to(torch.int64).contiguous()
    if not _C.kv_store_rows(x.data_ptr(), x.dtype == torch.bfloat16, flat.data_ptr(), flat.numel(), D,
                            KV_FORMATS[fmt], float(tensor_scale), data.data_ptr(), scales.data_ptr(),
                            platform.kernel_threads()):
        raise ValueError(f"{fmt}: input contains non-finite values (NaN or Inf); the format cannot encode them")


def _kv_width(data: torch.Tensor, scales: torch.Tensor, fmt: str) -> int:
    """Checks a quantised pool's pair of arrays -> values per row D."""
    if fmt not in KV_FORMATS:
        raise ValueError(f"KV rows: fmt must be one of {sorted(KV_FORMATS)}, got {fmt!r}")
    D = data.shape[-1] * (1 if fmt == "fp8" else 2)
    per_scale = {"fp8": D, "nvfp4": 16, "mxfp4": 32}[fmt]
    scale_dtype = torch.float32 if fmt == "fp8" else torch.uint8
    if (data.dtype != torch.uint8 or scales.dtype != scale_dtype or data.device.type != "cpu"
            or not (data.is_contiguous() and scales.is_contiguous()) or data.shape[:-1] != scales.shape[:-1]
            or scales.shape[-1] * per_scale != D):
        raise ValueError(f"{fmt} pool: data {data.dtype} {tuple(data.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} must be contiguous CPU uint8 [..., {'D' if fmt == 'fp8' else 'D/2'}] "
                         f"and {scale_dtype} [..., D/{per_scale}] alike")
    return D


def kv_load(packed, scales, block_table, indices, fmt: str, tensor_scale=1.0, dtype=torch.float32):
    """tilelang_ops.kv_load.kv_load_ref's arguments and result, bit for bit: the selected FP4 entries
    [B, k, D] in dtype (padding zeros) and valid [B, k]."""
    check_kv_load(packed, scales, block_table, indices, fmt)
    rows, valid = entry_slots(block_table, indices, packed.shape[1])
    return load_rows(packed, scales, torch.where(valid, rows, -1), fmt, dtype, tensor_scale), valid


def kv_store(x, slot_mapping, packed, scales, fmt: str, tensor_scale=1.0):
    """tilelang_ops.kv_store.kv_store_ref's arguments and effect, bit for bit: x [N, D] quantised into the pool
    rows slot_mapping [N] (< 0: skipped)."""
    check_kv_store(x, slot_mapping, packed, scales, fmt)
    keep = slot_mapping >= 0
    x = x if x.dtype in STREAM_DTYPES else x.float()  # fp16 widens exactly
    store_rows(x[keep], slot_mapping[keep], packed, scales, fmt, tensor_scale)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [T, ..., D] (fp32 or bf16) with DeepSeek-V4's interleaved rope on its trailing rd channels, cos / sin
    [T, rd] fp32 (v4_attention.apply_rope's contract, bit for bit; csrc/cpu/norm_rope.h)."""
    T, D, rd = x.shape[0], x.shape[-1], cos.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.shape != (T, rd) or not t.is_contiguous() or rd % 2 or rd > D:
            raise ValueError(f"rope_interleaved: {name} must be contiguous fp32 [{T}, rd] with an even rd <= {D}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _C.rope_interleaved(x.data_ptr(), T, x.numel() // max(1, T * D), D, rd, cos.data_ptr(), sin.data_ptr(), inverse,
                        out.data_ptr(), x.dtype == torch.bfloat16, platform.kernel_threads())
    return out


def fast_path(*tensors: torch.Tensor | None) -> bool:
    """Whether the C++ kernels take these tensors (None: an absent optional one): on the CPU, all of one
    dtype they read."""
    present = [t for t in tensors if t is not None]
    return all(t.device.type == "cpu" and t.dtype == present[0].dtype for t in present) \
        and present[0].dtype in STREAM_DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., n]; weight [n] in x.dtype or None -> [..., n]: transformers' RMSNorm (see csrc/cpu/norm_rope.h)."""
    n = x.shape[-1]
    if not fast_path(x):
        raise ValueError(f"rms_norm: x must be a CPU tensor of {STREAM_DTYPES}, got {x.dtype} on {x.device}")
    _check_vector(weight, "rms_norm weight", x.dtype, n)
    x2 = x.reshape(-1, n)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype)
    _C.rms_norm(x2.data_ptr(), x2.stride(0), _ptr(weight), out.data_ptr(),
                x2.shape[0], n, float(eps), x.dtype == torch.bfloat16, platform.kernel_threads())
    return out.view(x.shape)


def qk_norm_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) D] -> q [T, H, D] = rope(norm(q)); rope(norm(k)) and v go to k_cache, v_cache
    [blocks, block_size, Hkv, D] at slot_mapping [T]. q_weight, k_weight [D] or None (no q/k norm);
    cos, sin [max_position, D] fp32; positions [T]. See csrc/cpu/norm_rope.h."""
    t, width = qkv.shape
    h, hkv, d = num_heads, num_kv_heads, head_dim
    if width != (h + 2 * hkv) * d or d % 2 or not fast_path(qkv):
        raise ValueError(f"qk_norm_rope_store: qkv {qkv.dtype} {tuple(qkv.shape)} on {qkv.device} for {h} + 2 x {hkv} "
                         f"heads of an even {d}, in {STREAM_DTYPES}")
    _check_vector(q_weight, "q_weight", qkv.dtype, d)
    _check_vector(k_weight, "k_weight", qkv.dtype, d)
    _check_rope_tables(cos, sin, d)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(cache, name, qkv.dtype, 4)
        if cache.shape[2:] != (hkv, d):
            raise ValueError(f"{name}: expected [blocks, block_size, {hkv}, {d}], got {tuple(cache.shape)}")
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    pos, slots = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
    if pos.shape != (t,) or slots.shape != (t,):
        raise ValueError(f"positions {tuple(pos.shape)} and slot_mapping {tuple(slots.shape)} must be [{t}]")
    q = torch.empty(t, h, d, dtype=qkv.dtype)
    _C.qk_norm_rope_store(qkv.data_ptr(), qkv.stride(0), t, h, hkv, d, _ptr(q_weight), _ptr(k_weight), float(eps),
                          cos.data_ptr(), sin.data_ptr(), cos.shape[0], pos.data_ptr(), k_cache.data_ptr(),
                          v_cache.data_ptr(), k_cache.shape[0] * k_cache.shape[1], slots.data_ptr(), q.data_ptr(),
                          qkv.dtype == torch.bfloat16, platform.kernel_threads())
    return q


MAX_HC_STREAMS = 64  # the kernels keep one token's per-stream weights on the stack


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D] fp32/bf16; fn [(2+N)N, N*D], base [(2+N)N], scale [3] fp32 -> post [T, N] fp32,
    comb [T, N, N] fp32, collapsed [T, D] (streams' dtype). See csrc/cpu/hyper_connection.h."""
    _check(streams, "streams", STREAM_DTYPES, 3)
    t, n, d = streams.shape
    for name, p, shape in (("fn", fn, ((2 + n) * n, n * d)), ("base", base, ((2 + n) * n,)), ("scale", scale, (3,))):
        _check(p, name, torch.float32, len(shape))
        if tuple(p.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} for {n} streams of {d}, got {tuple(p.shape)}")
    if n > MAX_HC_STREAMS:
        raise ValueError(f"hc_mult = {n} streams; the kernel supports at most {MAX_HC_STREAMS}")
    post, comb, collapsed = torch.empty(t, n), torch.empty(t, n, n), torch.empty(t, d, dtype=streams.dtype)
    _C.hc_pre(streams.data_ptr(), streams.dtype == torch.bfloat16, fn.data_ptr(), base.data_ptr(), scale.data_ptr(),
              t, n, d, iters, hc_eps, norm_eps, post.data_ptr(), comb.data_ptr(), collapsed.data_ptr(),
              platform.kernel_threads())
    return post, comb, collapsed


def hc_merge(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """block_out [T, D], streams [T, N, D] (one dtype, fp32/bf16), post [T, N], comb [T, N, N] fp32 -> [T, N, D]."""
    _check(streams, "streams", STREAM_DTYPES, 3)
    _check(block_out, "block_out", streams.dtype, 2)
    _check(post, "post", torch.float32, 2)
    _check(comb, "comb", torch.float32, 3)
    t, n, d = streams.shape
    if block_out.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n) or n > MAX_HC_STREAMS:
        raise ValueError(f"hc_merge shapes disagree: block_out {tuple(block_out.shape)}, streams {tuple(streams.shape)}, "
                         f"post {tuple(post.shape)}, comb {tuple(comb.shape)}")
    out = torch.empty_like(streams)
    _C.hc_merge(block_out.data_ptr(), streams.data_ptr(), streams.dtype == torch.bfloat16, post.data_ptr(),
                comb.data_ptr(), t, n, d, out.data_ptr(), platform.kernel_threads())
    return out


def v4_decode_attention(q: torch.Tensor, ring: torch.Tensor, ring_len: torch.Tensor, comp: torch.Tensor,
                        comp_valid: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D], ring [B, W, D], ring_len [B], comp [B, K, D], comp_valid [B, K], sinks [H] -> [B, H, D]:
    the CPU implementation of tilelang_ops.v4_decode_attention's op (same arguments and result)."""
    check_v4_decode_attention(q, ring, ring_len, comp, comp_valid, sinks)
    if q.dtype not in STREAM_DTYPES or ring.dtype != q.dtype or comp.dtype != q.dtype:
        raise ValueError(f"v4_decode_attention: q/ring/comp must share dtype float32 or bfloat16, got "
                         f"{q.dtype}/{ring.dtype}/{comp.dtype}")
    B, H, D = q.shape
    W, K = ring.shape[1], comp.shape[1]
    q, ring, comp = q.contiguous(), ring.contiguous(), comp.contiguous()
    lens, valid = ring_len.to(torch.int64).contiguous(), comp_valid.to(torch.uint8).contiguous()
    sinks32 = sinks.float().contiguous()
    out = torch.empty_like(q)
    _C.v4_decode_attention(q.data_ptr(), ring.data_ptr(), lens.data_ptr(), comp.data_ptr(), valid.data_ptr(),
                           sinks32.data_ptr(), float(scale), out.data_ptr(), q.dtype == torch.bfloat16, B, H, D, W, K,
                           platform.kernel_threads())
    return out


def decode_attention_isas(dtype: torch.dtype, head_dim: int) -> list[str]:
    """The paths paged_decode_attention runs here for this dtype and head size: "avx512bf16" (bf16 dot products
    on bf16 caches, head_dim a multiple of 32), "avx512", "avx2" (widened to fp32)."""
    bf16 = dtype == torch.bfloat16
    return [isa for isa in ("avx512bf16", "avx512", "avx2")
            if isa in GEMM_ISAS and _C.decode_attention_runs(GEMM_ISAS[isa], bf16, head_dim)]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           isa: str | None = None) -> torch.Tensor:
    """q [B, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [B, max_blocks] (-1 padded);
    context_lens [B] >= 1 -> [B, H, D]: each query over its sequence's first context_lens cached keys.
    All of q and the caches fp32, or all bf16. isa: one of decode_attention_isas (None: the fastest).
    See csrc/cpu/decode_attention.h."""
    _check(q, "q", STREAM_DTYPES, 3)
    _check(k_cache, "k_cache", q.dtype, 4)
    _check(v_cache, "v_cache", q.dtype, 4)
    b, h, d = q.shape
    blocks, block_size, hkv, _ = k_cache.shape
    tables, lens = block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous()
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != d or h % hkv or tables.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"paged_decode_attention shapes disagree: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"block_tables {tuple(tables.shape)}, context_lens {tuple(lens.shape)}")
    if b and (int(lens.min()) < 1 or int(lens.max()) > tables.shape[1] * block_size):
        raise ValueError(f"context_lens must lie in [1, {tables.shape[1] * block_size}], got {lens.tolist()}")
    paths = decode_attention_isas(q.dtype, d)
    if isa is not None and isa not in paths:
        raise ValueError(f"paged_decode_attention: isa {isa!r} does not run {q.dtype} with head_dim {d} here; "
                         f"available: {paths}")
    out = torch.empty_like(q)
    _C.paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                              float(scale), out.data_ptr(), q.dtype == torch.bfloat16, b, h, hkv, d, block_size,
                              tables.shape[1], platform.kernel_threads(),
                              GEMM_ISAS[isa] if isa else _C.decode_attention_isa(q.dtype == torch.bfloat16, d))
    return out
