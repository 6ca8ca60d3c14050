"""Which GEMM runs each bf16-weight matmul on this CPU (and each fp32-weight one of an fp32 model).

Our kernels (csrc/cpu, one source instantiated per ISA) beat torch's bf16 GEMM 2-8x on AVX2-only CPUs.
On CPUs with AMX tiles torch's oneDNN path was 2.6-6x faster than our vector kernels from 16 rows on; our
AMX kernel beats it again up to ~128 rows (it reorders no weights), and oneDNN keeps prefill-sized M.
Nothing is assumed:
for each weight shape and bucket of row counts, every candidate that runs here is timed and the
fastest kept, on weights read from memory as a decode step reads them (cold_copies). Plans are cached
on disk by CPU, torch version, extension build and thread count.
The engine calibrates its model's shapes at start (`prepare`) and logs the table; a shape first met
later is calibrated on that call.

Paths: "cpu-<isa>" (our kernel, keys of cpu_ops.GEMM_ISAS; ISAs in cpu_ops.BF16_INPUT_ISAS for bf16 activations
only), "torch-bf16" (F.linear on bf16 operands: oneDNN; bf16 activations only, as it rounds its input and output to
bf16), "torch-fp32" (F.linear on widened weights: MKL's sgemm, which wins at prefill-sized M on AVX2). Experts
choose per expert between our grouped kernel (each ISA) and torch-bf16, by the expert's row count. An fp32 model's
linears and experts ("linear-fp32", "experts-fp32") choose between our kernels that read fp32 activations (on the
fp32 weights as they are) and torch-fp32. Weights packed in bf16 pairs (Linear / FusedMoE.pack_weights) have plans
of their own ("linear-packed", "experts-packed"): our packed kernel, or torch on the weight unpacked for the call.
Whether a shape's weights are packed at all is measured too ("linear-layout", "experts-layout"; packs_linear,
packs_experts): the engine packs them where their plan runs its steps' row counts faster packed.
Prefill attention of bf16 activations ("attention": torch's causal SDPA) runs in fp32 unless torch's bf16 SDPA
measures ATTENTION_MARGIN faster for the model's heads (attention_dtype).
"""
import itertools
import json
import logging
import math
import os
import time

import torch
import torch.nn.functional as F

from deepinfer import platform
from deepinfer.layers import cpu_ops

logger = logging.getLogger("deepinfer")

MAX_BUCKET = 512  # row buckets 1, 2, 4, ... 512; more rows use the 512 choice
CAL_MAX_N = 4096  # wider outputs are timed on their first rows: the time is linear in N
REPEATS = 3
# Calibration cycles through copies of the weights that fill this much memory, more than the last-level cache
# it shares: a decode step reads each weight once, from memory. Timed in cache, torch's bf16 GEMM won
# N 1536 x K 1024 from 4 rows on a Zen 4 although our kernel streamed the same weights from memory
# faster up to 31 rows. Tiny weights get at most MAX_COLD_COPIES copies (a model that small stays in cache).
COLD_BYTES = 128 << 20
MAX_COLD_COPIES = 64
MIN_TIMED_S = 5e-4  # tiny GEMMs are looped to at least this long per timing
PRUNE = 3.0
# The panel form takes the outer products only from 10 rows (WIDE_MIN_ROWS in csrc/cpu/gemm_bf16.cpp). The bucket
# of 8 is timed at 8 rows, where the panel form is the tiles: timing the two compares a kernel with itself, and a
# pick by noise would run rows 10-15 as zero-padded 16-row groups. So panels are timed from the bucket of 16.
PANELS_MIN_BUCKET = 16
# Bumped when the table's keys or choices change meaning, so no plan cached by an older rule is read (8: in the decode
# thread pair near ties with torch-bf16 go to our kernel, DECODE_TIE; 7: torch-fp32 must beat our kernel by
# TORCH_MARGIN; 6: panel forms timed from the bucket of 16; 5: packed weights have keys of their own; 4: "cpu-avx2"
# and "cpu-avx512" no longer take the panel form, now a path of its own; 3: the widest ISA within ISA_MARGIN; 2:
# experts choose an ISA per row bucket; 1 kept one ISA for all row counts).
PLAN_FORMAT = 8


def bucket(m: int) -> int:
    """Rows -> the power of two at or below (1 for 0), at most MAX_BUCKET."""
    return min(1 << (max(m, 1).bit_length() - 1), MAX_BUCKET)


def buckets_up_to(m: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(bucket(m))) + 1)]


def run_linear(path: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
               invariant: bool = False, packed: bool = False) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias) by one path -> [..., N] in x.dtype. packed: w is
    cpu_ops.pack_bf16_pairs(...), which torch's paths unpack for the call."""
    if path.startswith("cpu-"):
        return cpu_ops.linear_bf16(x, w, bias, isa=path[4:], invariant=invariant, packed=packed)
    w = cpu_ops.row_major(w, packed)
    if path == "torch-bf16":
        return F.linear(x, w, bias)
    out = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def torch_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """One SwiGLU expert through torch's GEMM in the weights' dtype (bf16: oneDNN, x rounded to bf16; fp32: MKL):
    x [M, H] fp32, w13 [2I, H], w2 [H, I] -> [M, H] fp32."""
    gate, up = F.linear(x.to(w13.dtype), w13).float().chunk(2, dim=-1)
    act = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    return F.linear(act.to(w2.dtype), w2).float()


def cold_copies(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Copies of tensors filling COLD_BYTES (at least 2, at most MAX_COLD_COPIES): [(t1, t2, ...), ...]. All
    candidates draw from one cycle over them, so each call reads the copy least recently read."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    count = min(MAX_COLD_COPIES, max(2, math.ceil(COLD_BYTES / max(size, 1))))
    return [tuple(t.clone() for t in tensors) for _ in range(count)]


def _seconds(fn) -> float:
    """Seconds per call, fn looped until MIN_TIMED_S has passed."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_TIMED_S:
            return elapsed / calls


def fastest(candidates: dict) -> tuple[str, dict[str, float]]:
    """{name: fn()} -> (the fastest name, {name: seconds}). Each is warmed once (oneDNN builds its
    primitive on the first call); then REPEATS rounds time every candidate in turn, so a load that
    comes and goes on a shared machine hits them alike, and each keeps its best. A candidate over
    PRUNE x the best is not timed again (one noisy first timing must not drop a close candidate: at
    1.5x, torch's bf16 GEMM was dropped on a slow first sample and our kernel kept a false lead)."""
    for fn in candidates.values():
        fn()
    times = {name: _seconds(fn) for name, fn in candidates.items()}
    for _ in range(REPEATS - 1):
        best = min(times.values())
        for name, fn in candidates.items():
            if times[name] < PRUNE * best:
                times[name] = min(times[name], _seconds(fn))
    return min(times, key=times.get), times


class GemmPlan:
    """The chosen path per (kind, activation dtype, shape, row bucket), measured on this machine.

    invariant: every GEMM runs our widest kernel with one reduction order for every row count, so a
    request's results do not depend on which others share its step (LLM(batch_invariant=True))."""

    def __init__(self):
        self.invariant = False
        self.table: dict[tuple, str] = {}  # _key(...) -> path, for the current thread counts
        self._tables: dict[tuple, dict] = {}  # _threads() -> its table
        self._loaded_threads = None
        self.model_shapes: set[tuple] = set()  # the last prepared model's shapes (plus any met later): what describe() lists
        self._layouts_logged: set[tuple] = set()

    @staticmethod
    def cpu_paths(dtype: torch.dtype = torch.bfloat16, rows: int = 1, packed: bool = False) -> list[str]:
        """Our kernel per ISA that keeps activations of this dtype exact (bf16 dot products only for bf16), with the
        panel forms only for row buckets where they differ from the tiles; for packed weights the one that reads them
        (bf16 activations only: it rounds its input to bf16)."""
        if packed:
            return [f"cpu-{cpu_ops.PACKED_ISA}"] if dtype == torch.bfloat16 else []
        return [f"cpu-{isa}" for isa in cpu_ops.GEMM_ISAS
                if (dtype == torch.bfloat16 or isa not in cpu_ops.BF16_INPUT_ISAS)
                and (rows >= PANELS_MIN_BUCKET or not isa.endswith("-panels"))]

    @staticmethod
    def invariant_path() -> str:
        return f"cpu-{cpu_ops.EXACT_ISA}"

    # -- lookups --------------------------------------------------------------------------------------

    def linear_path(self, dtype: torch.dtype, m: int, w: torch.Tensor, packed: bool = False) -> str:
        """The path for x [m, K] of dtype @ w [N, K]^T (w bf16, packed: in bf16 pairs; or fp32)."""
        if self.invariant:
            return self._invariant_path(dtype, packed)
        if dtype not in cpu_ops.STREAM_DTYPES:
            return "torch-fp32"
        self._load()
        key = _key(_kind("linear", packed, w.dtype), dtype, *w.shape, bucket(m))
        if key not in self.table:
            self._calibrate_linear(dtype, w, [bucket(m)], packed)
            self.model_shapes.add(key[:-1])
        return self.table[key]

    def _invariant_path(self, dtype: torch.dtype, packed: bool) -> str:
        """The packed kernel sums each output in k order whatever the rows: batch-invariant too (bf16 activations;
        fp32 ones take torch's fp32 GEMM, which is not)."""
        if packed:
            return (self.cpu_paths(dtype, packed=True) or ["torch-fp32"])[0]
        return self.invariant_path()

    def expert_paths(self, w13: torch.Tensor, w2: torch.Tensor, counts: list[int],
                     packed: bool = False) -> tuple[str, list[int]]:
        """w13 [E, 2I, H], w2 [E, H, I] bf16 (packed: in bf16 pairs) or fp32, counts [E] rows per expert -> (our
        grouped kernel's path, the experts that run through torch's GEMM instead: torch-bf16, or torch-fp32 for fp32
        weights). One call runs one ISA: the one chosen for the busiest expert our kernel keeps (the ISAs differ most
        at many rows; below 3 rows AMX runs dot products)."""
        if self.invariant:
            return self._invariant_path(torch.bfloat16, packed), []
        self._load()
        kind, shape = _kind("experts", packed, w13.dtype), _expert_shape(w13)
        missing = sorted({bucket(c) for c in counts if c and _key(kind, *shape, bucket(c)) not in self.table})
        if missing:
            self._calibrate_experts(w13, w2, missing, packed)
            self.model_shapes.add((kind, *shape))
        paths = [self.table[_key(kind, *shape, bucket(c))] if c else None for c in counts]
        ours = [(c, p) for c, p in zip(counts, paths) if p is not None and p.startswith("cpu-")]
        kernel = max(ours)[1] if ours else self.cpu_paths(w13.dtype, packed=packed)[0]
        return kernel, [e for e, p in enumerate(paths) if p is not None and p.startswith("torch-")]

    def attention_dtype(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> torch.dtype:
        """The dtype prefill attention (torch's causal SDPA over q [heads, L, head_dim] and kv_heads keys and values)
        runs in for activations of dtype: fp32, or bf16 for bf16 activations where torch's bf16 SDPA measured
        faster by ATTENTION_MARGIN here (oneDNN on AMX tiles); measured once per shape and thread counts."""
        if dtype != torch.bfloat16 or self.invariant:
            return torch.float32
        self._load()
        key = _key("attention", heads, kv_heads, head_dim)
        if key not in self.table:
            self._calibrate_attention(key)
        self.model_shapes.add(key)
        return torch.bfloat16 if self.table[key] == "torch-bf16" else torch.float32

    # -- calibration ----------------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, dtype: torch.dtype, max_rows: int, decode_rows: int) -> None:
        """Calibrates every Linear and FusedMoE of the model (bf16 or fp32 weights; activations in dtype) for the row
        counts of decode steps (1..decode_rows, torch on one thread) and of prefill steps (1..max_rows, inside
        platform.torch_parallel()), then logs the plan."""
        if self.invariant:
            logger.info("GEMM plan: batch-invariant, every GEMM on %s (%s)", self.invariant_path(), platform.cpu_flags())
            return
        self._calibrate_model(model, dtype, buckets_up_to(decode_rows))
        decode = self.describe()
        with platform.torch_parallel():
            self._calibrate_model(model, dtype, buckets_up_to(max_rows))
            prefill, torch_threads = self.describe(), torch.get_num_threads()
        self._load()
        if packed := cpu_ops.packed_read_order():
            logger.info("GEMM plan: %s", packed)
        for line in decode:
            logger.info("GEMM plan: %s", line)
        if self._loaded_threads[0] != torch_threads:
            for line in prefill:
                logger.info("GEMM plan for prefill (torch on %d threads): %s", torch_threads, line)

    def _calibrate_model(self, model: torch.nn.Module, dtype: torch.dtype, todo: list[int]) -> None:
        from deepinfer.layers.linear import Linear
        from deepinfer.layers.moe import FusedMoE

        self._load()
        seen = set()
        for mod in model.modules():
            if isinstance(mod, Linear) and mod.weight.dtype in cpu_ops.WEIGHT_DTYPES:
                w = mod.weight.data
                head = (_kind("linear", mod.packed, w.dtype), dtype, *w.shape)
                if head not in seen:
                    seen.add(head)
                    self._calibrate_linear(dtype, w, [b for b in todo if _key(*head, b) not in self.table], mod.packed)
            elif isinstance(mod, FusedMoE):
                w13, w2 = mod.gate_up_proj.data, mod.down_proj.data
                head = (_kind("experts", mod.packed, w13.dtype), *_expert_shape(w13))
                if head not in seen:
                    seen.add(head)
                    self._calibrate_experts(w13, w2, [b for b in todo if _key(*head, b) not in self.table], mod.packed)
        self.model_shapes = seen

    def _calibrate_linear(self, dtype: torch.dtype, w: torch.Tensor, rows: list[int], packed: bool = False,
                          also_packed: bool = False) -> dict[bool, dict[int, float]]:
        """Times every path at each row count and keeps the fastest -> {packed: {rows: seconds of the path chosen}}.
        packed: w is in bf16 pairs, timed on our packed kernel against torch's paths on the weight unpacked for
        each call (as run_linear runs them). also_packed: w is row-major and is timed packed too (a packed copy),
        the candidates of both layouts in one interleaved race."""
        n, k = w.shape
        layouts = _layouts(packed, also_packed)
        ring = _ring(rows, [w[:CAL_MAX_N]], layouts, packed)  # CAL_MAX_N % 16 == 0: whole packed blocks
        gen = torch.Generator().manual_seed(0)
        chosen = {layout: {} for layout in layouts}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            bf16 = dtype == w.dtype == torch.bfloat16
            paths = {layout: self.cpu_paths(dtype, m, layout) + (["torch-bf16"] if bf16 else []) + ["torch-fp32"]
                     for layout in layouts}
            times = fastest({(i, p): (lambda i=i, p=p, layout=layout: run_linear(p, x, next(ring)[i][0], None,
                                                                                  packed=layout))
                             for i, layout in enumerate(layouts) for p in paths[layout]})[1]
            self._keep(times, layouts, lambda layout: _key(_kind("linear", layout, w.dtype), dtype, n, k, m), chosen)
        self._save()
        return chosen

    def _calibrate_experts(self, w13: torch.Tensor, w2: torch.Tensor, rows: list[int], packed: bool = False,
                           also_packed: bool = False) -> dict[bool, dict[int, float]]:
        """Times one expert per thread (our kernel gives each thread whole experts) at each row count, on
        each of our ISAs and torch's GEMM (bf16; fp32 for fp32 weights, on which our fp32 ISAs run); a row count's
        choice is its fastest. -> {packed: {rows: seconds of the path chosen}}. packed: the experts are in bf16
        pairs, timed on our packed kernel against torch on each expert unpacked for the call (as FusedMoE runs
        them). also_packed: they are row-major and are timed packed too (packed copies), both layouts in one
        interleaved race."""
        e, two_i, h = w13.shape
        torch_path = "torch-fp32" if w13.dtype == torch.float32 else "torch-bf16"
        n_exp = min(e, platform.kernel_threads())
        layouts = _layouts(packed, also_packed)
        ring = _ring(rows, [w13[:n_exp], w2[:n_exp]], layouts, packed)
        gen = torch.Generator().manual_seed(0)
        chosen = {layout: {} for layout in layouts}
        for m in rows:
            x = torch.randn(m * n_exp, h, generator=gen)
            counts = torch.full((n_exp,), m)

            def run(i: int, path: str, m=m, x=x, counts=counts) -> None:
                w13s, w2s = next(ring)[i]
                if path.startswith("cpu-"):
                    cpu_ops.grouped_experts_bf16(x, counts, w13s, w2s, isa=path[4:], packed=layouts[i])
                    return
                for j in range(n_exp):
                    torch_expert(x[j * m:(j + 1) * m], cpu_ops.row_major(w13s[j], layouts[i]),
                                 cpu_ops.row_major(w2s[j], layouts[i]), math.inf)

            times = fastest({(i, p): (lambda i=i, p=p: run(i, p)) for i, layout in enumerate(layouts)
                             for p in self.cpu_paths(w13.dtype, m, layout) + [torch_path]})[1]
            self._keep(times, layouts, lambda layout: _key(_kind("experts", layout, w13.dtype), h, two_i, m), chosen)
        self._save()
        return chosen

    def _calibrate_attention(self, key: tuple) -> None:
        """key ("attention", heads, kv heads, head dim): times one ATTENTION_CAL_TOKENS-token causal SDPA in fp32 and
        in bf16; keeps bf16 only where it is ATTENTION_MARGIN faster (a near tie stays on fp32, the path every CPU ran
        before)."""
        _, heads, kv_heads, head_dim = key
        gen = torch.Generator().manual_seed(0)
        n = ATTENTION_CAL_TOKENS
        q, k, v = (torch.randn(1, h, n, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))

        def sdpa(dtype: torch.dtype):
            qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
            return lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=heads != kv_heads)

        times = fastest({"torch-fp32": sdpa(torch.float32), "torch-bf16": sdpa(torch.bfloat16)})[1]
        bf16 = times["torch-bf16"] < ATTENTION_MARGIN * times["torch-fp32"]
        self.table[key] = "torch-bf16" if bf16 else "torch-fp32"
        logger.info("GEMM plan: prefill attention H %d Hkv %d D %d: %s (%s)", heads, kv_heads, head_dim,
                    self.table[key], _fmt(times))
        self._save()

    def _keep(self, times: dict, layouts: list[bool], key, chosen: dict) -> None:
        """One row count's race, {(layout index, path): seconds} -> each layout's choice (_choose) in the table at
        key(layout), and its seconds in chosen[layout][rows]."""
        for i, layout in enumerate(layouts):
            mine = {p: t for (j, p), t in times.items() if j == i}
            k = key(layout)
            path = self.table[k] = _choose(mine, decode=torch.get_num_threads() == 1)
            chosen[layout][k[-1]] = mine[path]
            logger.debug("GEMM calibration %s rows %d: %s", _label(_encode(k[:-1])), k[-1], _fmt(mine))

    # -- layout ---------------------------------------------------------------------------------------

    def packs_linear(self, dtype: torch.dtype, w: torch.Tensor, rows: list[int]) -> bool:
        """Whether the row-major bf16 weight w [N, K] is faster packed in bf16 pairs for x [m, K] of dtype, m in
        the row buckets `rows` (as _packs decides)."""
        key = _key("linear-layout", dtype, *w.shape, max(rows))
        return self._packs(key, lambda: self._calibrate_linear(dtype, w, rows, also_packed=True))

    def packs_experts(self, w13: torch.Tensor, w2: torch.Tensor, rows: list[int]) -> bool:
        """Whether row-major experts w13 [E, 2I, H], w2 [E, H, I] are faster packed in bf16 pairs for `rows`
        (buckets of rows per expert), as _packs decides."""
        key = _key("experts-layout", *_expert_shape(w13), max(rows))
        return self._packs(key, lambda: self._calibrate_experts(w13, w2, rows, also_packed=True))

    def _packs(self, key: tuple, calibrate) -> bool:
        """calibrate() -> {packed: {rows: seconds}} of both layouts' plans. Packed when the geometric mean over
        the row buckets of packed / row-major time is below 1: every bucket counts alike, so decode steps of few
        rows weigh as much as the slower steps of many. Measured once per key and cached with the plan; logged
        once per process."""
        self._load()
        if key not in self.table:
            times = calibrate()
            plain, packed = times[False], times[True]
            ratio = math.exp(sum(math.log(packed[m] / plain[m]) for m in plain) / len(plain))
            self.table[key] = f"{'packed' if ratio < 1 else 'row-major'} {ratio:.2f}"
            self._save()
        if key not in self._layouts_logged:
            self._layouts_logged.add(key)
            logger.info("GEMM plan: %s up to %d rows: %s (packed / row-major time, geometric mean over row buckets)",
                        _label(_encode(key[:-1])), key[-1], self.table[key])
        return self.table[key].startswith("packed")

    # -- cache and report -----------------------------------------------------------------------------

    def describe(self) -> list[str]:
        """One line per shape of model_shapes (every cached shape before any prepare()): row ranges and
        their paths, e.g. "linear bfloat16 N 1536 K 1024: 1-15 cpu-avx2, 16+ torch-bf16"."""
        shapes: dict[str, list[tuple[int, str]]] = {}
        attention = []
        for key, path in self.table.items():
            if key[0] == "attention":
                if not self.model_shapes or key in self.model_shapes:
                    attention.append(f"{_label(_encode(key))}: {path}")
                continue
            if key[0].endswith("-layout"):
                continue
            if not self.model_shapes or key[:-1] in self.model_shapes:
                shapes.setdefault(_encode(key[:-1]), []).append((key[-1], path))
        return [f"{_label(head)}: {_ranges(sorted(runs))}" for head, runs in sorted(shapes.items())] + sorted(attention)

    def report(self) -> str:
        """The CPU's flags and the paths chosen so far, for a benchmark's output."""
        packed = cpu_ops.packed_read_order()
        return "\n".join([f"CPU: {platform.cpu_flags()}"] + ([packed] if packed else []) +
                         ["GEMM plan (shape: rows -> path):"] + [f"- {line}" for line in self.describe()])

    def _file(self) -> str:
        return platform.cache_path("gemm_plans", PLAN_FORMAT, *_threads())

    def _load(self) -> None:
        """Switches to the plan of the current thread counts (decode and prefill steps run torch on
        different counts), read from its cache file the first time."""
        threads = _threads()
        if self._loaded_threads == threads:
            return
        self._loaded_threads, self.table = threads, self._tables.setdefault(threads, {})
        if not self.table and os.path.exists(self._file()):
            with open(self._file()) as f:
                self.table.update({_decode(k): v for k, v in json.load(f).items()})

    def _save(self) -> None:
        path = self._file()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"  # DP ranks on one machine save the same file: rename is atomic
        with open(tmp, "w") as f:
            json.dump({_encode(k): v for k, v in self.table.items()}, f, indent=0, sort_keys=True)
        os.replace(tmp, path)


# Our kernel replaces torch's bf16 GEMM only when it measures this much faster: a close race is decided
# by the moment's noise, and the plan should not flip to a path that is no faster. Torch's fp32 GEMM (bf16 weights
# widened per call) must beat our kernel by as much to replace it: in near ties (Zen 3, packed N 1024 / 1536 x
# K 1024 at 128-512 rows) each rebuild's calibration picked a different side, and the prefill rate moved with it.
TORCH_MARGIN = 0.9


# Of our kernels, the widest ISA is kept unless another measures this much faster. Calibration times weights
# that sit in cache, while a decode step streams them from memory, where the wider ISA's fewer instructions
# per byte count: experts of 4-7 rows measured 5-6% faster on AMX than on the fp32 AVX-512 kernel in the
# engine (medium Qwen3-MoE, batch 16: 147-154 against 157-161 ms/step) after calibration had chosen AVX-512.
ISA_MARGIN = 1.1


# Prefill attention leaves fp32 for torch's bf16 SDPA only when bf16 is this much faster: on AVX2 bf16 is several
# times slower, on Zen 4 (AVX512-BF16) they tie (135.7 against 137.6 ms for a 2048-token causal SDPA, 16 heads, 4 kv
# heads, D 64, one thread), and a tie decided by noise would change a model's outputs between machines of one kind.
ATTENTION_MARGIN = 0.8
ATTENTION_CAL_TOKENS = 1024


# In the decode thread pair (torch on one thread, platform.set_threads) a GEMM that the plan gives to torch cannot run
# in the C++ decode step, and the whole step falls back to the Python path: on a Zen 4 a fresh plan gave qkv's bucket
# of 64 rows to torch's bf16 GEMM (row-major weights, a near tie) and batch-64 steps took 190-210 ms against 159-171
# with it on our kernel. There a near tie goes to our kernel: torch's bf16 GEMM replaces it only when ours takes over
# DECODE_TIE of torch's time (inside the 10% the plan promises against torch).
DECODE_TIE = 1.05


def _choose(times: dict[str, float], decode: bool = False) -> str:
    """{path: seconds}, our paths widest ISA first -> our widest path within ISA_MARGIN of our fastest, or
    torch-fp32 if it beats that by TORCH_MARGIN, or torch-bf16 unless the pick beats it by TORCH_MARGIN (decode:
    unless the pick takes over DECODE_TIE of torch-bf16's time)."""
    ours = [p for p in times if p.startswith("cpu-")]
    if ours:
        best_ours = min(times[p] for p in ours)
        keep = next(p for p in ours if times[p] <= ISA_MARGIN * best_ours)
        times = {p: t for p, t in times.items() if p == keep or not p.startswith("cpu-")}
        if "torch-fp32" in times and times["torch-fp32"] > TORCH_MARGIN * times[keep]:
            del times["torch-fp32"]
    rest = [p for p in times if p != "torch-bf16"]
    if "torch-bf16" not in times or not rest:
        return min(times, key=times.get)
    best = min(rest, key=times.get)
    return "torch-bf16" if times[best] > (DECODE_TIE if decode else TORCH_MARGIN) * times["torch-bf16"] else best


def _threads() -> tuple[int, int]:
    """(torch's threads, our kernels' threads): a plan holds for one pair."""
    return torch.get_num_threads(), platform.kernel_threads()


def _key(kind: str, *parts) -> tuple:
    """("linear" / "linear-packed" / "linear-fp32", x dtype, N, K, rows) or ("experts" / "experts-packed" /
    "experts-fp32", H, 2I, rows): a lookup per GEMM call, so a plain tuple. "linear-layout" / "experts-layout" keys
    end in the largest row bucket and map to "packed <ratio>" or "row-major <ratio>" (_packs); ("attention", heads,
    kv heads, head dim) maps to prefill attention's "torch-fp32" or "torch-bf16" (attention_dtype)."""
    return (kind, *parts)


def _encode(key: tuple) -> str:
    return "|".join(str(p).replace("torch.", "") for p in key)


def _decode(text: str) -> tuple:
    kind, *rest = text.split("|")
    parts = [int(p) if p.isdigit() else p for p in rest]
    if kind.startswith("linear"):
        parts[0] = getattr(torch, parts[0])
    return (kind, *parts)


def _label(head: str) -> str:
    """"linear|bfloat16|1536|1024" -> "linear bfloat16 N 1536 K 1024"; "experts|1024|1024" -> "experts H 1024 2I 1024";
    "experts-packed|..." -> "experts H .. 2I .. (packed)"; "experts-layout|..." -> "experts H .. 2I .. layout";
    "experts-fp32|..." -> "experts H .. 2I .. (fp32 weights)"."""
    p = head.split("|")
    if p[0] == "attention":
        return f"prefill attention H {p[1]} Hkv {p[2]} D {p[3]}"
    suffix = {"packed": " (packed)", "layout": " layout", "fp32": " (fp32 weights)"}.get(p[0].rpartition("-")[2], "")
    if p[0].startswith("linear"):
        return f"linear {p[1]} N {p[2]} K {p[3]}{suffix}"
    return f"experts H {p[1]} 2I {p[2]}{suffix}"


def _layouts(packed: bool, also_packed: bool) -> list[bool]:
    """The weight layouts a calibration times (True: bf16 pairs)."""
    if also_packed and packed:
        raise ValueError("also_packed times row-major weights packed; these are packed already")
    return [packed, True] if also_packed else [packed]


def _ring(rows: list[int], weights: list[torch.Tensor], layouts: list[bool], packed: bool):
    """A cycle over cold copies of the weights in each layout: next(ring)[i] holds them in layouts[i] (packed: the
    weights given are in bf16 pairs already). Empty when no rows are timed."""
    if not rows:
        return itertools.cycle([])
    forms = [w if layout == packed else cpu_ops.pack_bf16_pairs(w) for layout in layouts for w in weights]
    per = len(weights)
    return itertools.cycle([tuple(c[i * per:(i + 1) * per] for i in range(len(layouts))) for c in cold_copies(*forms)])


def _kind(base: str, packed: bool, dtype: torch.dtype = torch.bfloat16) -> str:
    """A key's kind: "linear" / "experts", with "-packed" for weights in bf16 pairs, "-fp32" for fp32 weights."""
    return f"{base}-packed" if packed else f"{base}-fp32" if dtype == torch.float32 else base


def _expert_shape(w13: torch.Tensor) -> tuple[int, int]:
    """[E, 2I, H] -> (H, 2I): experts of one shape share a plan whatever their count."""
    return w13.shape[2], w13.shape[1]


def _fmt(times: dict[str, float]) -> str:
    return ", ".join(f"{p} {t * 1e3:.3f} ms" for p, t in times.items())


def _ranges(runs: list[tuple[int, str]]) -> str:
    """[(1, a), (2, a), (4, b)] -> "1-3 a, 4+ b" (a bucket covers rows up to the next one)."""
    parts, i = [], 0
    while i < len(runs):
        j = i
        while j + 1 < len(runs) and runs[j + 1][1] == runs[i][1]:
            j += 1
        hi = "+" if j + 1 == len(runs) else f"-{runs[j + 1][0] - 1}"
        parts.append(f"{runs[i][0]}{hi} {runs[i][1]}")
        i = j + 1
    return ", ".join(parts)


PLAN = GemmPlan()  # one per process: the machine and the build are
