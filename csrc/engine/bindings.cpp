// pybind11 module deepinfer._C: the C++ engine core. schedule() and process() run with the GIL
// released; std exceptions become Python ValueError / RuntimeError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine/mtp_varlen.h"
#include "engine/scheduler.h"

namespace py = pybind11;
using namespace deepinfer;

template <typename T>
static py::array_t<T> to_numpy(const std::vector<T>& v) {
  return py::array_t<T>(static_cast<py::ssize_t>(v.size()), v.data());
}

void bind_cpu_kernels(py::module_& m);

// (src block, dst block, src slot, dst slot): what CacheEngine copies for a forked sequence.
static py::tuple copy_tuple(const ForkCopy& c) {
  return py::make_tuple(c.src_block, c.dst_block, c.src_slot, c.dst_slot);
}

// [R, k] confidences (numpy or nested lists) -> rows; copying in C++ is far cheaper than pybind11's
// per-element conversion of nested lists.
static std::vector<std::vector<double>> rows_of(const py::array_t<double>& conf) {
  if (conf.ndim() != 2) throw std::invalid_argument("confidences must be a 2-D [requests, drafts] array");
  auto a = conf.unchecked<2>();
  std::vector<std::vector<double>> rows(a.shape(0), std::vector<double>(a.shape(1)));
  for (py::ssize_t r = 0; r < a.shape(0); ++r)
    for (py::ssize_t j = 0; j < a.shape(1); ++j) rows[r][j] = a(r, j);
  return rows;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepinfer C++ core: sequences, block manager, scheduler, input prep, output processing";

  py::enum_<EngineType>(m, "EngineType")
      .value("NORMAL", EngineType::NORMAL)
      .value("PROMPT", EngineType::PROMPT)
      .value("COMPLETION", EngineType::COMPLETION);
  py::enum_<StepType>(m, "StepType")
      .value("IDLE", StepType::IDLE)
      .value("PREFILL", StepType::PREFILL)
      .value("DECODE", StepType::DECODE);
  py::enum_<SequenceStatus>(m, "SequenceStatus")
      .value("WAITING", SequenceStatus::WAITING)
      .value("RUNNING", SequenceStatus::RUNNING)
      .value("HANDED_OFF", SequenceStatus::HANDED_OFF)
      .value("FINISHED", SequenceStatus::FINISHED);
  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::NONE)
      .value("STOP", FinishReason::STOP)
      .value("LENGTH", FinishReason::LENGTH)
      .value("ABORT", FinishReason::ABORT)
      .value("ERROR", FinishReason::ERROR)
      .value("HANDOFF", FinishReason::HANDOFF);

  py::class_<SamplingLimits>(m, "SamplingLimits")
      .def(py::init<>())
      .def(py::init([](int max_tokens, int min_tokens, bool ignore_eos, std::vector<int32_t> stops) {
             return SamplingLimits{max_tokens, min_tokens, ignore_eos, std::move(stops)};
           }),
           py::arg("max_tokens"), py::arg("min_tokens") = 0, py::arg("ignore_eos") = false,
           py::arg("stop_token_ids") = std::vector<int32_t>{})
      .def_readwrite("max_tokens", &SamplingLimits::max_tokens)
      .def_readwrite("min_tokens", &SamplingLimits::min_tokens)
      .def_readwrite("ignore_eos", &SamplingLimits::ignore_eos)
      .def_readwrite("stop_token_ids", &SamplingLimits::stop_token_ids);

  py::class_<Sequence>(m, "Sequence")
      .def_readonly("seq_id", &Sequence::seq_id)
      .def_readonly("token_ids", &Sequence::token_ids)
      .def_readonly("num_prompt_tokens", &Sequence::num_prompt_tokens)
      .def_readonly("num_computed_tokens", &Sequence::num_computed_tokens)
      .def_readonly("status", &Sequence::status)
      .def_readonly("finish_reason", &Sequence::finish_reason)
      .def_readonly("block_table", &Sequence::block_table)
      .def_readonly("state_slot", &Sequence::state_slot)
      .def_readonly("limits", &Sequence::limits)
      .def_readonly("schedule_cnt", &Sequence::schedule_cnt)
      .def_readonly("process_cnt", &Sequence::process_cnt)
      .def_readonly("num_preemptions", &Sequence::num_preemptions)
      .def_property_readonly("num_tokens", &Sequence::num_tokens)
      .def_property_readonly("num_output_tokens", &Sequence::num_output_tokens);

  py::class_<BlockManager>(m, "BlockManager")
      .def(py::init<int, int>(), py::arg("num_blocks"), py::arg("block_size"))
      .def_property_readonly("block_size", &BlockManager::block_size)
      .def_property_readonly("num_blocks", &BlockManager::num_blocks)
      .def_property_readonly("num_free_blocks", &BlockManager::num_free_blocks)
      .def("ref_count", &BlockManager::ref_count)
      .def("blocks_for", &BlockManager::blocks_for)
      .def("can_allocate", &BlockManager::can_allocate)
      .def("allocate", &BlockManager::allocate)
      .def("append", [](BlockManager& bm, std::vector<int> table, int num_tokens) {
        bool ok = bm.append(table, num_tokens);
        return py::make_tuple(ok, table);
      })
      .def("incref", &BlockManager::incref)
      .def("free", &BlockManager::free)
      .def("check", &BlockManager::check);

  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init<>())
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &SchedulerConfig::max_model_len)
      .def_readwrite("block_size", &SchedulerConfig::block_size)
      .def_readwrite("num_blocks", &SchedulerConfig::num_blocks)
      .def_readwrite("num_state_slots", &SchedulerConfig::num_state_slots)
      .def_readwrite("long_prefill_token_threshold", &SchedulerConfig::long_prefill_token_threshold)
      .def_readwrite("chunked_prefill", &SchedulerConfig::chunked_prefill)
      .def_readwrite("engine_type", &SchedulerConfig::engine_type)
      .def_readwrite("eos_token_ids", &SchedulerConfig::eos_token_ids);

  py::class_<ScheduledBatch>(m, "ScheduledBatch")
      .def_readonly("type", &ScheduledBatch::type)
      .def_readonly("seq_ids", &ScheduledBatch::seq_ids)
      .def_readonly("preempted", &ScheduledBatch::preempted)
      .def_property_readonly("num_seqs", [](const ScheduledBatch& b) { return b.seq_ids.size(); })
      .def_property_readonly("num_tokens", [](const ScheduledBatch& b) { return b.input_ids.size(); })
      .def_property_readonly("input_ids", [](const ScheduledBatch& b) { return to_numpy(b.input_ids); })
      .def_property_readonly("positions", [](const ScheduledBatch& b) { return to_numpy(b.positions); })
      .def_property_readonly("slot_mapping", [](const ScheduledBatch& b) { return to_numpy(b.slot_mapping); })
      .def_property_readonly("query_start_loc",
                             [](const ScheduledBatch& b) { return to_numpy(b.query_start_loc); })
      .def_property_readonly("context_lens", [](const ScheduledBatch& b) { return to_numpy(b.context_lens); })
      .def_property_readonly("state_slots", [](const ScheduledBatch& b) { return to_numpy(b.state_slots); })
      .def_property_readonly("draft_lens", [](const ScheduledBatch& b) { return to_numpy(b.draft_lens); })
      .def_property_readonly("sampled", [](const ScheduledBatch& b) { return to_numpy(b.sampled); })
      .def_property_readonly("block_tables", [](const ScheduledBatch& b) {
        py::array_t<int32_t> a = to_numpy(b.block_tables);
        return a.reshape({static_cast<py::ssize_t>(b.seq_ids.size()), static_cast<py::ssize_t>(b.max_blocks)});
      });

  py::class_<StepOutput>(m, "StepOutput")
      .def_readonly("seq_id", &StepOutput::seq_id)
      .def_readonly("tokens", &StepOutput::tokens)
      .def_readonly("finished", &StepOutput::finished)
      .def_readonly("reason", &StepOutput::reason)
      .def_readonly("stop_token", &StepOutput::stop_token);

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<const SchedulerConfig&>())
      .def("add_sequence", &Scheduler::add_sequence, py::arg("seq_id"), py::arg("prompt"), py::arg("limits"),
           py::arg("num_cached_tokens") = 0)
      .def("import_sequence", &Scheduler::import_sequence, py::arg("seq_id"), py::arg("tokens"),
           py::arg("num_prompt_tokens"), py::arg("limits"))
      .def("schedule", &Scheduler::schedule, py::arg("want") = StepType::IDLE,
           py::call_guard<py::gil_scoped_release>())
      .def("can_prefill", &Scheduler::can_prefill)
      .def("schedule_ahead", &Scheduler::schedule_ahead, py::arg("flight"), py::call_guard<py::gil_scoped_release>())
      .def("complete_ahead", &Scheduler::complete_ahead, py::arg("ahead"), py::call_guard<py::gil_scoped_release>())
      .def("discard", &Scheduler::discard, py::arg("batch"))
      .def("process", &Scheduler::process, py::call_guard<py::gil_scoped_release>())
      .def("process_multi", &Scheduler::process_multi, py::call_guard<py::gil_scoped_release>())
      .def("set_drafts", &Scheduler::set_drafts, py::arg("seq_id"), py::arg("drafts"))
      .def("finish", &Scheduler::finish)
      .def("release", &Scheduler::release)
      .def("fork", [](Scheduler& s, int64_t parent_id, int64_t child_id, int32_t last_token) {
        return copy_tuple(s.fork(parent_id, child_id, last_token));
      }, py::arg("parent_id"), py::arg("child_id"), py::arg("last_token"))
      .def("add_sibling", [](Scheduler& s, int64_t parent_id, int64_t child_id, int32_t token) {
        auto [res, copy] = s.add_sibling(parent_id, child_id, token);
        return py::make_tuple(res, copy_tuple(copy));
      }, py::arg("parent_id"), py::arg("child_id"), py::arg("token"))
      .def("set_last_token", &Scheduler::set_last_token, py::arg("seq_id"), py::arg("token"))
      .def("sequence", &Scheduler::sequence, py::return_value_policy::copy)
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def("running_ids", &Scheduler::running_ids)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_free_state_slots", &Scheduler::num_free_state_slots)
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions)
      .def_property_readonly("block_manager", &Scheduler::block_manager, py::return_value_policy::reference_internal)
      .def("check_invariants", &Scheduler::check_invariants);

  py::class_<StepTimeCurve>(m, "StepTimeCurve")
      .def(py::init<std::vector<double>, std::vector<double>>(), py::arg("tokens"), py::arg("ms"))
      .def("ms", &StepTimeCurve::ms)
      .def_property_readonly("tokens", &StepTimeCurve::tokens)
      .def_property_readonly("times", &StepTimeCurve::times);
  py::class_<MTPVarlen>(m, "MTPVarlen")
      .def(py::init<StepTimeCurve>(), py::arg("curve"))
      .def("schedule", [](const MTPVarlen& v, const py::array_t<double>& c) { return v.schedule(rows_of(c)); },
           py::arg("confidences"))
      .def("budget", [](const MTPVarlen& v, const py::array_t<double>& c) { return v.budget(rows_of(c)); },
           py::arg("confidences"))
      .def_static("distribute", [](int budget, const py::array_t<double>& c) {
        return MTPVarlen::distribute(budget, rows_of(c));
      }, py::arg("budget"), py::arg("confidences"))
      .def_property_readonly("curve", &MTPVarlen::curve);

  bind_cpu_kernels(m);
}
