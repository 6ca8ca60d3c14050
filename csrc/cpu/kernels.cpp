// CPU kernels where torch is slow, registered into deepinfer._C. They take raw data pointers
// (validated by deepinfer/layers/cpu_ops.py, the only caller) and run with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpu/attention_block.h"
#include "cpu/cpu_features.h"
#include "cpu/decode_step.h"
#include "cpu/decode_attention.h"
#include "cpu/gemm_bf16.h"
#include "cpu/hyper_connection.h"
#include "cpu/kv_quant.h"
#include "cpu/moe_block.h"
#include "cpu/moe.h"
#include "cpu/norm_rope.h"
#include "cpu/sampling.h"
#include "cpu/scratch.h"
#include "engine/decode_loop.h"
#include "engine/scheduler.h"

namespace py = pybind11;
using namespace deepinfer;

namespace {

// The GEMM kernels by name and id (kernel_mode), narrowest first: each ISA's dot-product tiles, and
// the fp32 ISAs' panel form after their tiles.
std::vector<std::pair<const char*, int>> gemm_kernels() {
  constexpr int avx2 = static_cast<int>(Isa::AVX2), avx512 = static_cast<int>(Isa::AVX512);
  return {{"avx2-panels", avx2 | KERNEL_PANELS}, {"avx2", avx2}, {"avx512-panels", avx512 | KERNEL_PANELS},
          {"avx512", avx512}, {"avx512bf16", static_cast<int>(Isa::AVX512_BF16)}, {"amx", static_cast<int>(Isa::AMX)}};
}

// A kernel the CPU lacks would fault on its first instruction: refuse it as a Python error. packed: the
// weights are in bf16 pairs, which only the AVX512-BF16 kernel and the AVX2 tiles read.
GemmMode gemm_mode(int id, bool invariant, bool packed = false) {
  for (auto [name, known] : gemm_kernels()) {
    if (known != id) continue;
    GemmMode mode = kernel_mode(id, invariant, packed);
    if (!isa_supported(mode.isa))
      throw py::value_error(std::string("GEMM kernel ") + name + " is not supported by this CPU");
    if (packed && mode.isa != Isa::AVX512_BF16 && !(mode.isa == Isa::AVX2 && !mode.panels))
      throw py::value_error(std::string("GEMM kernel ") + name + " cannot read packed weights (avx512bf16 or avx2)");
    return mode;
  }
  throw py::value_error("unknown GEMM kernel id " + std::to_string(id));
}

// gemm_mode for weights that are fp32 (an fp32 model's) when fp32_weights: only the fp32 ISAs' row-major kernels
// read those.
GemmMode weight_mode(int id, bool invariant, bool packed, bool fp32_weights) {
  GemmMode mode = gemm_mode(id, invariant, packed);
  if (fp32_weights && (packed || (mode.isa != Isa::AVX2 && mode.isa != Isa::AVX512)))
    throw py::value_error("fp32 weights run on the avx2 / avx512 kernels, row-major only");
  return mode;
}

DecodeBatch decode_batch(int64_t T, uintptr_t positions, uintptr_t slots, uintptr_t block_tables, int64_t max_blocks,
                         uintptr_t context_lens) {
  return {T, reinterpret_cast<const int64_t*>(positions), reinterpret_cast<const int64_t*>(slots),
          reinterpret_cast<const int64_t*>(block_tables), max_blocks, reinterpret_cast<const int64_t*>(context_lens)};
}

// attention_block's failures as Python errors, prefixed by where they happened.
void raise_attention_status(AttentionBlockStatus status, const AttentionBlock& b, int64_t max_blocks,
                            const std::string& where) {
  if (status == AttentionBlockStatus::BAD_POSITION_OR_SLOT)
    throw py::index_error(where + ": a position or slot_mapping entry is out of range");
  if (status == AttentionBlockStatus::BAD_CONTEXT_LEN)
    throw py::value_error(where + ": context_lens must lie in [1, max_blocks * block_size = " +
                          std::to_string(max_blocks * b.block_size) + "]");
  if (status == AttentionBlockStatus::BAD_BLOCK)
    throw py::value_error(where + ": block_tables holds a block id outside [0, " + std::to_string(b.num_blocks) +
                          ") within a context");
}

[[noreturn]] void raise_bad_expert(const MoeBlock& b, const std::string& where) {
  throw py::value_error(where + ": log2phy maps an expert outside [0, " + std::to_string(b.num_physical) + ")");
}

// decode_step's failures as Python errors (nothing raised for a step that ran).
void raise_decode_status(const DecodeStatus& status, const DecoderStack& stack, const int64_t* ids, int64_t max_blocks) {
  if (status.ok()) return;
  if (status.bad_row >= 0)
    throw py::index_error("decode_step: input id " + std::to_string(ids[status.bad_row]) + " of row " +
                          std::to_string(status.bad_row) + " is outside the embedding's " +
                          std::to_string(stack.embed_rows) + " rows");
  const DecoderLayer& layer = stack.layers[status.layer];
  const std::string where = "decode_step: layer " + std::to_string(status.layer);
  raise_attention_status(status.attention, *layer.attention, max_blocks, where);
  raise_bad_expert(*layer.moe, where);
}

// What decode_drawn and decode_steps take: a decode batch of one token per sequence and a stack with a head.
void check_drawn_batch(const DecoderStack& stack, const ScheduledBatch& batch) {
  if (batch.type != StepType::DECODE || batch.input_ids.size() != batch.seq_ids.size())
    throw py::value_error("decode_drawn: the batch must be a decode step of one token per sequence");
  if (!stack.head) throw py::value_error("decode_drawn: drawn tokens need a stack with a head");
}

// Draws from None (all greedy) or six sequences of `rows` values each: temperature, top_k, top_p, min_p, seeds,
// offsets.
// The number of top logprobs a drawn step can report: -1 (none) up to the vocabulary.
void check_num_logprobs(const DecoderStack& stack, int64_t n) {
  if (n < -1 || n > stack.head->vocab)
    throw py::value_error("num_logprobs must be -1 (none) or 0.." + std::to_string(stack.head->vocab) +
                          " (the vocabulary), got " + std::to_string(n));
}

// A step's logprobs as numpy arrays (token_logprob [T], rank [T], top_ids [T,n], top_logprobs [T,n]), or None.
py::object logprobs_arrays(StepLogprobs& lp) {
  if (lp.n < 0) return py::none();
  const auto T = static_cast<py::ssize_t>(lp.rank.size()), n = static_cast<py::ssize_t>(lp.n);
  return py::make_tuple(py::array_t<float>(T, lp.token_logprob.data()), py::array_t<int64_t>(T, lp.rank.data()),
                        py::array_t<int64_t>({T, n}, lp.top_ids.data()),
                        py::array_t<float>({T, n}, lp.top_logprobs.data()));
}

Draws draws_of(const py::object& sampling, size_t rows) {
  Draws s;
  if (sampling.is_none()) return s;
  const auto t = sampling.cast<py::tuple>();
  if (t.size() != 6) throw py::value_error("sampling is (temperature, top_k, top_p, min_p, seeds, offsets)");
  s.temperature = t[0].cast<std::vector<float>>();
  s.top_k = t[1].cast<std::vector<int64_t>>();
  s.top_p = t[2].cast<std::vector<float>>();
  s.min_p = t[3].cast<std::vector<float>>();
  s.seeds = t[4].cast<std::vector<int64_t>>();
  s.offsets = t[5].cast<std::vector<int64_t>>();
  for (size_t n : {s.temperature.size(), s.top_k.size(), s.top_p.size(), s.min_p.size(), s.seeds.size(),
                   s.offsets.size()})
    if (n != rows) throw py::value_error("sampling needs one value of each per row of the batch");
  return s;
}

py::dict features_dict() {
  const CpuFeatures& f = cpu_features();
  py::dict d;
  d["model"] = f.model;
  d["avx2"] = f.avx2;
  d["fma"] = f.fma;
  d["avx512f"] = f.avx512f;
  d["avx512bw"] = f.avx512bw;
  d["avx512vl"] = f.avx512vl;
  d["avx512_bf16"] = f.avx512_bf16;
  d["amx_tile"] = f.amx_tile;
  d["amx_bf16"] = f.amx_bf16;
  py::list isas;
  for (auto [name, id] : gemm_kernels())
    if (isa_supported(kernel_mode(id, false).isa)) isas.append(py::make_tuple(name, id));
  d["gemm_isas"] = isas;
  return d;
}

}  // namespace

void bind_cpu_kernels(py::module_& m) {
  m.def("cpu_features", &features_dict,
        "what this CPU and OS support (cpuid / xgetbv), and the GEMM kernels that run here as (name, id), narrowest first");
  m.def(
      "linear_bf16",
      [](uintptr_t x, uintptr_t w, uintptr_t bias, bool fp32_weights, uintptr_t out, bool bf16_io, int64_t M,
         int64_t K, int64_t N, int isa, bool invariant, bool packed, int threads) {
        GemmMode mode = weight_mode(isa, invariant, packed, fp32_weights);
        py::gil_scoped_release release;
        with_weights(reinterpret_cast<const void*>(w), reinterpret_cast<const void*>(bias), fp32_weights,
                     [&](auto wp, auto biasp) {
          linear_bf16(reinterpret_cast<const void*>(x), wp, biasp, reinterpret_cast<void*>(out), bf16_io, M, K, N,
                      mode, threads);
        });
      },
      "out[M,N] = x[M,K] @ w[N,K]^T (+ bias[N], 0 for none); w and bias bf16, or fp32 when fp32_weights; x and out "
      "both fp32 or both bf16 (bf16_io)");
  m.attr("PAIR_BLOCK") = PAIR_BLOCK;
  m.def("single_panel_stream", &single_panel_stream,
        "Whether packed GEMMs of up to 4 rows read one weight panel at a time (see set_single_panel_stream)");
  m.def(
      "keep_scratch",
      [](bool on) {
        if (!keep_scratch(on)) throw py::value_error("keep_scratch(False): no keep scope is open");
      },
      py::arg("on"),
      "Opens (on) or closes a scope in which the kernels' scratch buffers keep their pages whatever their size "
      "(cpu/scratch.h); closing the last frees this thread's large ones");
  m.def("scratch_bytes", &scratch_bytes, "Bytes the calling thread's kernel scratch buffers hold");
  m.def("set_single_panel_stream", &set_single_panel_stream, py::arg("on"),
        "Packed GEMMs of up to 4 rows read one weight panel at a time (on) or several in parallel; returns the "
        "previous setting (default: on where transparent huge pages are not off)");
  m.def(
      "pack_bf16_pairs",
      [](uintptr_t src, uintptr_t dst, int64_t N, int64_t K, bool unpack) {
        if (N % PAIR_BLOCK || K % 2)
          throw py::value_error("pack_bf16_pairs: N must be a multiple of " + std::to_string(PAIR_BLOCK) +
                                " and K even, got N " + std::to_string(N) + ", K " + std::to_string(K));
        py::gil_scoped_release release;
        pack_bf16_pairs(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint16_t*>(dst), N, K, unpack);
      },
      "w [N,K] bf16 -> dst [N/16][K/2][16][2] (the layout packed GEMMs read), or back when unpack");
  m.def(
      "grouped_experts_bf16",
      [](uintptr_t x, uintptr_t offsets, int64_t E, uintptr_t skip, uintptr_t w13, uintptr_t w2, bool fp32_weights,
         uintptr_t y, int64_t H, int64_t I, float limit, int isa, bool invariant, bool packed, int threads) {
        GemmMode mode = weight_mode(isa, invariant, packed, fp32_weights);
        py::gil_scoped_release release;
        with_weights(reinterpret_cast<const void*>(w13), reinterpret_cast<const void*>(w2), fp32_weights,
                     [&](auto w13p, auto w2p) {
          grouped_experts_bf16(reinterpret_cast<const float*>(x), reinterpret_cast<const int64_t*>(offsets), E,
                               reinterpret_cast<const uint8_t*>(skip), w13p, w2p, reinterpret_cast<float*>(y), H, I,
                               limit, mode, threads);
        });
      },
      "y[S,H] fp32: rows offsets[e]..offsets[e+1] of x [S,H] through SwiGLU expert e (w13 [E,2I,H], w2 [E,H,I] "
      "bf16, or fp32 when fp32_weights), gate and up clamped at limit; experts with skip[e] (uint8 [E], 0 for none) "
      "left unwritten");
  m.def(
      "moe_experts_bf16",
      [](uintptr_t x, uintptr_t ids, uintptr_t weights, bool bf16, int64_t T, int64_t k, int64_t E, uintptr_t skip,
         uintptr_t w13, uintptr_t w2, bool fp32_weights, uintptr_t y, int64_t H, int64_t I, float limit, int isa,
         bool invariant, bool packed, int threads) {
        GemmMode mode = weight_mode(isa, invariant, packed, fp32_weights);
        bool ok;
        {
          py::gil_scoped_release release;
          with_weights(reinterpret_cast<const void*>(w13), reinterpret_cast<const void*>(w2), fp32_weights,
                       [&](auto w13p, auto w2p) {
            ok = moe_experts_bf16(reinterpret_cast<const void*>(x), reinterpret_cast<const int64_t*>(ids),
                                  reinterpret_cast<const void*>(weights), bf16, T, k, E,
                                  reinterpret_cast<const uint8_t*>(skip), w13p, w2p, reinterpret_cast<float*>(y), H,
                                  I, limit, mode, threads);
          });
        }
        if (!ok) throw py::value_error("moe_experts_bf16: topk_ids must lie in [0, " + std::to_string(E) + ")");
      },
      "y [T,H] fp32 = sum_j weights[t,j] * expert_{ids[t,j]}(x[t]) over experts without skip[e] (uint8 [E], 0: none)");
  py::class_<AttentionBlock>(m, "AttentionBlock",
                             "a decoder layer's attention-half weights and caches, checked by cpu_ops.attention_block_weights")
      .def(py::init([](int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, uintptr_t norm_w, float eps,
                       uintptr_t qkv, uintptr_t qkv_bias, int qkv_isa, uintptr_t q_norm, uintptr_t k_norm, float qk_eps,
                       uintptr_t cos, uintptr_t sin, int64_t num_positions, uintptr_t k_cache, uintptr_t v_cache,
                       int64_t num_blocks, int64_t block_size, uintptr_t o, uintptr_t o_bias, int o_isa, float scale,
                       bool invariant, bool qkv_packed, bool o_packed, bool fp32_weights) {
        AttentionBlock b;
        b.hidden = hidden, b.heads = heads, b.kv_heads = kv_heads, b.head_dim = head_dim;
        b.norm_w = reinterpret_cast<const void*>(norm_w), b.eps = eps;
        b.qkv = reinterpret_cast<const void*>(qkv), b.qkv_bias = reinterpret_cast<const void*>(qkv_bias);
        b.qkv_mode = weight_mode(qkv_isa, invariant, qkv_packed, fp32_weights), b.fp32_weights = fp32_weights;
        b.q_norm = reinterpret_cast<const void*>(q_norm), b.k_norm = reinterpret_cast<const void*>(k_norm);
        b.qk_eps = qk_eps, b.cos = reinterpret_cast<const float*>(cos), b.sin = reinterpret_cast<const float*>(sin);
        b.num_positions = num_positions, b.k_cache = reinterpret_cast<void*>(k_cache);
        b.v_cache = reinterpret_cast<void*>(v_cache), b.num_blocks = num_blocks, b.block_size = block_size;
        b.o = reinterpret_cast<const void*>(o), b.o_bias = reinterpret_cast<const void*>(o_bias);
        b.o_mode = weight_mode(o_isa, invariant, o_packed, fp32_weights), b.scale = scale;
        return b;
      }));
  py::class_<MoeBlock>(m, "MoeBlock", "a Qwen3-MoE layer's second-half weights, checked by cpu_ops.moe_block_weights")
      .def(py::init([](int64_t H, int64_t I, uintptr_t norm_w, float eps, uintptr_t gate, int64_t num_logical,
                       int64_t top_k, bool renorm, int gate_isa, int64_t num_physical, uintptr_t w13, uintptr_t w2,
                       const std::vector<int>& expert_isa, bool invariant, bool packed, bool gate_packed,
                       bool fp32_weights) {
        MoeBlock b;
        b.H = H, b.I = I, b.norm_w = reinterpret_cast<const void*>(norm_w), b.eps = eps;
        b.gate = reinterpret_cast<const void*>(gate), b.num_logical = num_logical, b.top_k = top_k;
        b.renorm = renorm, b.gate_mode = weight_mode(gate_isa, invariant, gate_packed, fp32_weights);
        b.num_physical = num_physical, b.w13 = reinterpret_cast<const void*>(w13);
        b.w2 = reinterpret_cast<const void*>(w2), b.invariant = invariant, b.packed = packed;
        b.fp32_weights = fp32_weights;
        // each must run on this CPU and these weights
        for (int isa : expert_isa) weight_mode(isa, invariant, packed, fp32_weights);
        if (expert_isa.empty()) throw py::value_error("moe_block: expert_isa is empty");
        b.expert_isa = expert_isa;
        return b;
      }));
  py::class_<DecodeHead>(m, "DecodeHead", "a model's final norm and LM head, checked by cpu_ops.decode_head_weights")
      .def(py::init([](uintptr_t norm_w, float eps, uintptr_t lm_head, int64_t vocab, int isa, bool invariant,
                       bool packed, bool fp32_weights) {
        DecodeHead h;
        h.norm_w = reinterpret_cast<const void*>(norm_w), h.eps = eps;
        h.lm_head = reinterpret_cast<const void*>(lm_head), h.vocab = vocab, h.fp32_weights = fp32_weights;
        h.mode = weight_mode(isa, invariant, packed, fp32_weights);
        return h;
      }));
  m.def(
      "attention_block",
      [](uintptr_t x, uintptr_t out, int64_t T, bool bf16, uintptr_t positions, uintptr_t slots,
         uintptr_t block_tables, int64_t max_blocks, uintptr_t context_lens, int threads, const AttentionBlock& b) {
        AttentionBlockStatus status;
        {
          py::gil_scoped_release release;
          status = attention_block(b, reinterpret_cast<const void*>(x), reinterpret_cast<void*>(out),
                                   decode_batch(T, positions, slots, block_tables, max_blocks, context_lens), bf16,
                                   threads);
        }
        raise_attention_status(status, b, max_blocks, "attention_block");
      },
      "out [T,hidden] = o_proj(paged attention(q/k norm + rope + KV store(qkv_proj(rms_norm(x))))) for decode");
  m.def(
      "moe_block",
      [](uintptr_t x, uintptr_t a, uintptr_t out, int64_t T, bool bf16, uintptr_t counts, uintptr_t log2phy,
         int threads, const MoeBlock& b) {
        bool ok;
        {
          py::gil_scoped_release release;
          ok = moe_block(b, reinterpret_cast<int64_t*>(counts), reinterpret_cast<const int64_t*>(log2phy),
                         reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(a), reinterpret_cast<void*>(out),
                         T, bf16, threads);
        }
        if (!ok) raise_bad_expert(b, "moe_block");
      },
      "out [T,H] = x1 + moe(rms_norm(x1)), x1 = x + a: Qwen3-MoE's residual, norm, top-k router and experts");
  py::class_<DecoderStack>(m, "DecoderStack", "a model's decode-time weights, checked by cpu_ops.decoder_stack")
      .def(py::init([](uintptr_t embed, int64_t embed_rows, const std::vector<AttentionBlock*>& attention,
                       const std::vector<MoeBlock*>& moe, const std::vector<uintptr_t>& log2phy,
                       const DecodeHead* head) {
             if (attention.empty() || moe.size() != attention.size() || log2phy.size() != attention.size())
               throw py::value_error("decoder_stack: one attention half, MoE half and log2phy per layer, at least one");
             DecoderStack s;
             s.embed = reinterpret_cast<const void*>(embed), s.embed_rows = embed_rows;
             for (size_t l = 0; l < attention.size(); ++l)
               s.layers.push_back({attention[l], moe[l], reinterpret_cast<const int64_t*>(log2phy[l])});
             if (head) s.head = *head;
             return s;
           }),
           py::keep_alive<1, 4>(), py::keep_alive<1, 5>());  // the layers point at these halves
  m.def(
      "decode_step",
      [](const DecoderStack& stack, uintptr_t ids, uintptr_t counts, uintptr_t out, uintptr_t logits, int64_t T,
         bool bf16, uintptr_t positions, uintptr_t slots, uintptr_t block_tables, int64_t max_blocks,
         uintptr_t context_lens, int threads) {
        const auto* id = reinterpret_cast<const int64_t*>(ids);
        DecodeStatus status;
        {
          py::gil_scoped_release release;
          status = decode_step(stack, id, reinterpret_cast<int64_t*>(counts),
                               decode_batch(T, positions, slots, block_tables, max_blocks, context_lens), bf16, threads,
                               reinterpret_cast<void*>(out), reinterpret_cast<float*>(logits));
        }
        raise_decode_status(status, stack, id, max_blocks);
      },
      "out [T,hidden] = the stack's layers (attention_block, moe_block) over embed[ids] at decode, in one call; with "
      "its head also logits [T,vocab] fp32 = lm_head(norm(out))");
  m.def(
      "decode_drawn",
      [](const DecoderStack& stack, const ScheduledBatch& batch, py::object sampling, uintptr_t counts, bool bf16,
         int threads, int64_t num_logprobs) {
        check_drawn_batch(stack, batch);
        check_num_logprobs(stack, num_logprobs);
        const Draws draws = draws_of(sampling, batch.seq_ids.size());
        py::array_t<int64_t> tokens(static_cast<py::ssize_t>(batch.seq_ids.size()));
        int64_t* drawn = tokens.mutable_data();
        StepLogprobs logprobs{num_logprobs};
        DecodeStatus status;
        {
          py::gil_scoped_release release;
          status = decode_drawn(stack, batch, draws, reinterpret_cast<int64_t*>(counts), bf16, threads, drawn,
                                &logprobs);
        }
        raise_decode_status(status, stack, batch.input_ids.data(), batch.max_blocks);
        return py::make_tuple(tokens, logprobs_arrays(logprobs));
      },
      "(tokens [T] int64, logprobs): decode_step over a scheduled decode batch's own arrays with the stack's head, "
      "each row's first argmax of its logits, or with sampling = (temperature, top_k, top_p, min_p, seeds, offsets) "
      "per row sample_tokens' draw (-1 for a row with NaN or inf); logprobs None (num_logprobs < 0) or token_logprobs' "
      "(token_logprob [T], rank [T], top_ids [T,n], top_logprobs [T,n]) with n = num_logprobs");
  m.def(
      "decode_steps",
      [](const DecoderStack& stack, Scheduler& scheduler, const ScheduledBatch& first, int max_steps,
         py::object sampling, int64_t num_logprobs, uintptr_t counts, int64_t counts_per_step, bool bf16, int threads,
         py::list done) {
        check_drawn_batch(stack, first);
        check_num_logprobs(stack, num_logprobs);
        if (max_steps < 1) throw py::value_error("decode_steps: max_steps must be at least 1");
        const Draws draws = draws_of(sampling, first.seq_ids.size());
        LoopSteps r;
        {
          py::gil_scoped_release release;
          r = run_decode_steps(scheduler, stack, first, max_steps, draws, num_logprobs,
                               reinterpret_cast<int64_t*>(counts), counts_per_step, bf16, threads);
        }
        // The steps that ran reach the caller before a failure is raised: they are processed.
        for (LoopStep& step : r.done)
          done.append(py::make_tuple(std::move(step.batch), std::move(step.outputs), logprobs_arrays(step.logprobs)));
        raise_decode_status(r.status, stack, r.failed.input_ids.data(), r.failed.max_blocks);
        return r.preempted;
      },
      "runs `first` and up to max_steps - 1 more decode steps, each drawn as decode_drawn (sampling: per row of "
      "first, at offset + the steps its sequence ran here; num_logprobs as decode_drawn's), scheduled and processed "
      "by the scheduler, appending (batch, outputs, logprobs) per step to done; returns the sequences a last "
      "schedule evicted");
  m.def(
      "greedy_tokens",
      [](uintptr_t logits, int64_t B, int64_t V, uintptr_t tokens, int threads) {
        greedy_tokens(reinterpret_cast<const float*>(logits), B, V, reinterpret_cast<int64_t*>(tokens), threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "tokens [B] int64 = first argmax of each row of logits [B,V] fp32, -1 for a row with NaN or inf");
  m.def(
      "sample_tokens",
      [](uintptr_t logits, int64_t B, int64_t V, uintptr_t temperature, uintptr_t top_k, uintptr_t top_p,
         uintptr_t min_p, uintptr_t seeds, uintptr_t offsets, uintptr_t tokens, int threads) {
        sample_tokens(reinterpret_cast<const float*>(logits), B, V, reinterpret_cast<const float*>(temperature),
                      reinterpret_cast<const int64_t*>(top_k), reinterpret_cast<const float*>(top_p),
                      reinterpret_cast<const float*>(min_p), reinterpret_cast<const int64_t*>(seeds),
                      reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<int64_t*>(tokens), threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "tokens [B] int64 = tilelang_ops.sampling.sample_ref's draw from logits [B,V] fp32 and per-row parameters");
  m.def(
      "token_logprobs",
      [](uintptr_t logits, int64_t B, int64_t V, uintptr_t tokens, int64_t n, uintptr_t token_logprob, uintptr_t rank,
         uintptr_t top_ids, uintptr_t top_logprobs, int threads) {
        token_logprobs(reinterpret_cast<const float*>(logits), B, V, reinterpret_cast<const int64_t*>(tokens), n,
                       reinterpret_cast<float*>(token_logprob), reinterpret_cast<int64_t*>(rank),
                       reinterpret_cast<int64_t*>(top_ids), reinterpret_cast<float*>(top_logprobs), threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "token_logprob [B] fp32, rank [B] int64 and the n most likely (top_ids, top_logprobs [B,n]) of logits [B,V] "
      "fp32 at tokens [B] int64, as log_softmax gives them; rows with tokens < 0 untouched");
  m.def("gumbel_approx_error", &gumbel_approx_error, py::call_guard<py::gil_scoped_release>(),
        "largest |vector - C library| Gumbel noise over all 2^23 uniforms of the draw (bound: GUMBEL_ERROR)");
  m.attr("GUMBEL_ERROR") = kGumbelError;
  m.def(
      "apply_token_mask",
      [](uintptr_t logits, uintptr_t bitmask, int64_t B, int64_t V, int threads) {
        apply_token_mask(reinterpret_cast<float*>(logits), reinterpret_cast<const int32_t*>(bitmask), B, V, threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "logits [B,V] fp32 = -inf where the token's bit in bitmask [B,ceil(V/32)] int32 is clear, in place");
  m.def(
      "kv_load_rows",
      [](uintptr_t data, uintptr_t scales, uintptr_t rows, int64_t n, int64_t D, int fmt, float tensor_scale,
         uintptr_t out, bool out_bf16, int threads) {
        kv_load_rows(reinterpret_cast<const uint8_t*>(data), reinterpret_cast<const void*>(scales),
                     reinterpret_cast<const int64_t*>(rows), n, D, static_cast<KvFormat>(fmt), tensor_scale,
                     reinterpret_cast<void*>(out), out_bf16, threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "out [n, D] = pool rows `rows` [n] (< 0: zeros) dequantised (fmt 0 FP8, 1 NVFP4, 2 MXFP4)");
  m.def(
      "kv_store_rows",
      [](uintptr_t x, bool x_bf16, uintptr_t rows, int64_t n, int64_t D, int fmt, float tensor_scale, uintptr_t data,
         uintptr_t scales, int threads) {
        return kv_store_rows(reinterpret_cast<const void*>(x), x_bf16, reinterpret_cast<const int64_t*>(rows), n, D,
                             static_cast<KvFormat>(fmt), tensor_scale, reinterpret_cast<uint8_t*>(data),
                             reinterpret_cast<void*>(scales), threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "pool rows `rows` [n] = x [n, D] quantised; false (nothing written) when x is not all finite");
  m.def(
      "rope_interleaved",
      [](uintptr_t x, int64_t T, int64_t R, int64_t D, int64_t rd, uintptr_t cos, uintptr_t sin, bool inverse,
         uintptr_t out, bool bf16, int threads) {
        rope_interleaved(reinterpret_cast<const void*>(x), T, R, D, rd, reinterpret_cast<const float*>(cos),
                         reinterpret_cast<const float*>(sin), inverse, reinterpret_cast<void*>(out), bf16, threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "out [T, R, D] = x with DeepSeek-V4's interleaved rope on the trailing rd channels (cos, sin [T, rd] fp32)");
  m.def(
      "rms_norm",
      [](uintptr_t x, int64_t x_stride, uintptr_t w, uintptr_t out, int64_t rows, int64_t n, float eps, bool bf16,
         int threads) {
        rms_norm(reinterpret_cast<const void*>(x), x_stride, reinterpret_cast<const void*>(w),
                 reinterpret_cast<void*>(out), rows, n, eps, bf16, threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "out [rows, n] = w * round(x * rsqrt(mean(x^2) + eps)) (w 0 for none); x rows x_stride elements apart");
  m.def(
      "qk_norm_rope_store",
      [](uintptr_t qkv, int64_t qkv_stride, int64_t T, int64_t H, int64_t Hkv, int64_t D, uintptr_t q_w, uintptr_t k_w,
         float eps, uintptr_t cos, uintptr_t sin, int64_t num_positions, uintptr_t positions, uintptr_t k_cache,
         uintptr_t v_cache, int64_t num_slots, uintptr_t slots, uintptr_t q_out, bool bf16, int threads) {
        bool ok;
        {
          py::gil_scoped_release release;
          ok = qk_norm_rope_store(reinterpret_cast<const void*>(qkv), qkv_stride, T, H, Hkv, D,
                                  reinterpret_cast<const void*>(q_w), reinterpret_cast<const void*>(k_w), eps,
                                  reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                                  num_positions, reinterpret_cast<const int64_t*>(positions),
                                  reinterpret_cast<void*>(k_cache), reinterpret_cast<void*>(v_cache), num_slots,
                                  reinterpret_cast<const int64_t*>(slots), reinterpret_cast<void*>(q_out), bf16,
                                  threads);
        }
        if (!ok)
          throw py::index_error("qk_norm_rope_store: a position lies past the rotary table or a slot past the cache");
      },
      "q [T,H,D] = rope(norm(q)); rope(norm(k)) and v stored to the caches at slots, from qkv [T,(H+2Hkv)D]");
  m.def(
      "hc_pre",
      [](uintptr_t streams, bool bf16, uintptr_t fn, uintptr_t base, uintptr_t scale, int64_t T, int64_t N, int64_t D,
         int iters, float hc_eps, float norm_eps, uintptr_t post, uintptr_t comb, uintptr_t collapsed, int threads) {
        hc_pre(reinterpret_cast<const void*>(streams), bf16, reinterpret_cast<const float*>(fn),
               reinterpret_cast<const float*>(base), reinterpret_cast<const float*>(scale), T, N, D, iters, hc_eps,
               norm_eps, reinterpret_cast<float*>(post), reinterpret_cast<float*>(comb),
               reinterpret_cast<void*>(collapsed), threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "mHC pre-block: streams [T,N,D] -> post [T,N], comb [T,N,N] fp32, collapsed [T,D]");
  m.def(
      "hc_merge",
      [](uintptr_t block_out, uintptr_t streams, bool bf16, uintptr_t post, uintptr_t comb, int64_t T, int64_t N,
         int64_t D, uintptr_t out, int threads) {
        hc_merge(reinterpret_cast<const void*>(block_out), reinterpret_cast<const void*>(streams), bf16,
                 reinterpret_cast<const float*>(post), reinterpret_cast<const float*>(comb), T, N, D,
                 reinterpret_cast<void*>(out), threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "mHC merge: out [T,N,D] = post (x) block_out + comb^T @ streams");
  m.def(
      "v4_decode_attention",
      [](uintptr_t q, uintptr_t ring, uintptr_t ring_len, uintptr_t comp, uintptr_t comp_valid, uintptr_t sinks,
         float scale, uintptr_t out, bool bf16, int64_t B, int64_t H, int64_t D, int64_t W, int64_t K, int threads) {
        v4_decode_attention(reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(ring),
                            reinterpret_cast<const int64_t*>(ring_len), reinterpret_cast<const void*>(comp),
                            reinterpret_cast<const uint8_t*>(comp_valid), reinterpret_cast<const float*>(sinks), scale,
                            reinterpret_cast<void*>(out), bf16, B, H, D, W, K, threads);
      },
      py::call_guard<py::gil_scoped_release>(),
      "DeepSeek-V4 decode attention: q [B,H,D] over ring [B,W,D] (first ring_len rows) and comp [B,K,D] where valid");
  m.def(
      "paged_decode_attention",
      [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables, uintptr_t context_lens, float scale,
         uintptr_t out, bool bf16, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
         int threads, int isa) {
        paged_decode_attention(reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k_cache),
                               reinterpret_cast<const void*>(v_cache), reinterpret_cast<const int64_t*>(block_tables),
                               reinterpret_cast<const int64_t*>(context_lens), scale, reinterpret_cast<void*>(out), bf16,
                               B, H, Hkv, D, block_size, max_blocks, threads, static_cast<Isa>(isa));
      },
      py::call_guard<py::gil_scoped_release>(),
      "Paged GQA decode attention: q [B,H,D] over each sequence's first context_lens keys of its block table, on "
      "path isa (one decode_attention_runs accepts)");
  m.def(
      "decode_attention_runs",
      [](int isa, bool bf16, int64_t D) { return decode_attention_runs(static_cast<Isa>(isa), bf16, D); },
      "Whether paged_decode_attention has path isa for these inputs on this CPU");
  m.def(
      "decode_attention_isa",
      [](bool bf16, int64_t D) { return static_cast<int>(decode_attention_isa(bf16, D)); },
      "The fastest paged_decode_attention path for these inputs on this CPU");
}
