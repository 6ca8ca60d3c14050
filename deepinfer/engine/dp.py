"""Data-parallel attention, expert-parallel MoE: k engine ranks (Ray actors), one step type per step.

Each rank (`DPRankWorker`) is a full LLMEngine with its own C++ scheduler, requests, KV pools and
attention weights, but only the routed experts of its physical slots (`placement.local_slots(rank)`,
redundant slots of an EPLB plan included); shared experts, and a drafter's MoE layer, stay replicated. MoE layers dispatch and combine tokens
across ranks (distributed/ep_moe.py). With enable_eplb the group replans on its all-reduced load and
expert weights move between rank processes (distributed/expert_transfer.py). Every step the ranks
all-reduce what work they have and `StepVote` picks one step type for all of them; a rank with nothing
of that type runs a dummy step (its MoE layers join every all-to-all with zero tokens of their own),
and a drained rank keeps doing so until the whole group is done.

The front (`DPEngine`, in the caller's process) has LLMEngine's surface (add_request / step /
has_unfinished / validate_request / abort_all): it assigns requests to ranks with `DecodeBalancer`,
starts one session per batch of requests (a Ray call per rank) and gathers finished requests over zmq.

Forcing a step type: each rank runs `engine.step(voted type)`, and the C++ scheduler schedules only that
type (an empty result becomes a dummy step). New requests still wait in a Python queue on the rank and
enter the C++ scheduler on PREFILL steps, as many as it will admit, so the vote's "has prefill work"
reflects requests not yet admitted.
"""
import dataclasses
import logging
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass

from deepinfer import _C, platform
from deepinfer.config import EngineConfig, dataclass_from_dict, hf_get
from deepinfer.engine.balancers import DecodeBalancer, kv_at_end
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.layers.moe import balanced_moe_blocks

logger = logging.getLogger("deepinfer")

PREFILL, DECODE = _C.StepType.PREFILL, _C.StepType.DECODE


@dataclass
class DPConfig:
    """LLM(dp_config=...) keys. Intervals count decode steps since the group's last prefill."""

    prefill_attempt_interval: int = 4       # ask "do ALL ranks have prefill work?" every N decode steps
    prefill_any_attempt_interval: int = 16  # ask "does ANY rank?" every N: a lone prompt waits <= N steps
    num_cpus_per_rank: float = 0.5         # Ray resources; fractional so two ranks fit on two cores
    num_gpus_per_rank: float = 0.0
    collective_timeout_s: float = 60.0     # a collective stuck this long (peer gone) raises
    start_timeout_s: float = 300.0         # rank start: Ray worker, imports, model load
    poll_ms: int = 50                      # front: how long one step() waits for outputs

    @classmethod
    def from_dict(cls, d: dict | None) -> "DPConfig":
        cfg = dataclass_from_dict(cls, d, "dp_config")
        for name in ("prefill_attempt_interval", "prefill_any_attempt_interval", "poll_ms"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LLM(dp_config={{{name!r}: {value!r}}}) must be a positive integer")
        return cfg


# ----------------------------------------------------------------------------------------------------
# policy: the vote (pure Python, no Ray); the balancer is engine/balancers.py


class StepVote:
    """The group's step-type policy. Every rank runs it on the same all-reduced counts, so all agree.

    Decode is the default (it keeps every running sequence moving). Prefill runs when
      - no rank has decode work and some rank has prefill work;
      - on every `all_interval`-th decode step since the last prefill, if ALL ranks have prefill work;
      - on every `any_interval`-th one, if ANY rank has.
    A prompt that fits therefore waits at most `any_interval` decode steps."""

    def __init__(self, all_interval: int = 4, any_interval: int = 16):
        self.all_interval, self.any_interval = all_interval, any_interval
        self.decode_steps = 0  # decode steps since the last prefill

    def decide(self, num_prefill: int, num_decode: int, world_size: int):
        """Counts of ranks with prefill / decode work -> PREFILL, DECODE, or None (group done)."""
        if num_prefill == 0 and num_decode == 0:
            return None
        c = self.decode_steps
        ask_all = c > 0 and c % self.all_interval == 0 and num_prefill == world_size
        ask_any = c > 0 and c % self.any_interval == 0 and num_prefill > 0
        if num_prefill > 0 and (num_decode == 0 or ask_all or ask_any):
            self.decode_steps = 0
            return PREFILL
        self.decode_steps += 1
        return DECODE


# ----------------------------------------------------------------------------------------------------
# rank


class _ObservedScheduler:
    """Wraps the C++ scheduler for LLMEngine to record the type of each scheduled batch."""

    def __init__(self, sched):
        self._sched = sched
        self.last_type = None

    def schedule(self, want=_C.StepType.IDLE):
        batch = self._sched.schedule(want)
        self.last_type = batch.type
        return batch

    def __getattr__(self, name):
        return getattr(self._sched, name)


@dataclass
class RankStats:
    """Per session. Times in seconds; forward excludes the time inside all-to-alls."""

    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    dummy_steps: int = 0
    mismatched: int = 0
    tokens: int = 0
    vote_s: float = 0.0
    forward_s: float = 0.0
    a2a_s: float = 0.0
    a2a_bytes: int = 0
    wall_s: float = 0.0


class DPRankWorker:
    """One DP rank (the body of a Ray actor, or of a disaggregated engine's rank: engine/disagg.py). Requests
    are LLMEngine.add_request's positional arguments (request_id, prompt_token_ids, params, prompt[, child])."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, port: int, out_address: str | None,
                 dp: DPConfig):
        from deepinfer.distributed.channels import Sender
        from deepinfer.distributed.process_groups import DPGroup

        logging.basicConfig(level=logging.INFO, format=f"[dp rank {rank}] %(message)s")
        self.rank, self.world_size, self.dp = rank, world_size, dp
        self.group = DPGroup(rank, world_size, port, timeout_s=dp.collective_timeout_s)
        self.engine = LLMEngine(_rank_config(config, world_size), agree=self.group.agree)
        self.sched = _ObservedScheduler(self.engine.scheduler)
        self.engine.scheduler = self.sched
        self.ep_layers, self.ep_stats = self._shard_experts()
        self.moe_blocks = balanced_moe_blocks(self.engine.model)
        self.vote = StepVote(dp.prefill_attempt_interval, dp.prefill_any_attempt_interval)
        self.out = Sender(out_address) if out_address else None  # None: the caller publishes outputs
        self.pending: deque = deque()
        # Group-wide EPLB: every rank counts the same steps, so all replan at the same step.
        self.eplb_enabled = config.enable_eplb and bool(self.moe_blocks)
        self.group_steps, self.num_replans, self.num_moved, self.num_received = 0, 0, 0, 0

    def _shard_experts(self):
        """Keeps only this rank's slots of every MoE layer and installs the expert-parallel hook."""
        import torch

        from deepinfer.distributed.ep_moe import EPStats, ExpertParallel, shard_experts

        stats = EPStats()
        blocks = balanced_moe_blocks(self.engine.model)
        if not blocks:
            raise ValueError("data_parallel_size > 1 shards routed experts, and the model has none")
        placement = self.engine.eplb.placement
        self.engine.eplb.enabled = False  # its replanning moves weights within one process only
        top_k = int(hf_get(self.engine.hf_config, "num_experts_per_tok"))
        slots = placement.local_slots(self.rank)
        for b in blocks:
            b.experts = shard_experts(b.experts, slots)
            b.ep = ExpertParallel(self.rank, self.world_size, placement.slots_per_gpu, top_k,
                                  self.engine.config.dtype, self.group.ep_group, stats)
        getattr(self.engine.model, "weights_changed", lambda: None)()
        platform.set_threads(self.engine.config.num_threads)
        return [(b.ep, b.experts) for b in blocks], stats

    def pid(self) -> int:
        return os.getpid()

    def local_slots(self) -> list[int]:
        return list(self.engine.eplb.placement.local_slots(self.rank)) if self.moe_blocks else []

    def num_ep_layers(self) -> int:
        return len(self.ep_layers)

    def run_session(self, requests: list) -> dict:
        """Queues the requests, then steps with the group until no rank has work. Finished requests go
        to the front over zmq as (rank, [RequestOutput]). Returns this rank's RankStats as a dict."""
        self.pending.extend(requests)
        stats, start = RankStats(), time.perf_counter()
        self.ep_stats.reset()
        while True:
            has_prefill, has_decode = self.has_prefill(), self.sched.num_running > 0
            t = time.perf_counter()
            num_prefill, num_decode = self.group.vote(has_prefill, has_decode)
            stats.vote_s += time.perf_counter() - t
            kind = self.vote.decide(num_prefill, num_decode, self.world_size)
            if kind is None:
                break
            finished = self.step(kind, has_prefill, has_decode, stats)
            if finished:
                self.out.send((self.rank, finished))
        stats.a2a_s, stats.a2a_bytes = self.ep_stats.a2a_s, self.ep_stats.bytes_sent
        stats.wall_s = time.perf_counter() - start
        logger.info("session done: %d steps (%d prefill, %d decode, %d dummy, %d mismatched)", stats.steps,
                    stats.prefill_steps, stats.decode_steps, stats.dummy_steps, stats.mismatched)
        return dataclasses.asdict(stats)

    def step(self, kind, has_prefill: bool, has_decode: bool, stats: RankStats) -> list:
        """Runs the voted step type, or a dummy step when this rank has none of it. Returns the requests
        that finished."""
        t, a2a = time.perf_counter(), self.ep_stats.a2a_s
        finished, num_tokens = [], 0
        if (kind == PREFILL and has_prefill) or (kind == DECODE and has_decode):
            if kind == PREFILL:
                self._admit()
            finished, num_tokens = self.engine.step(kind)
        if num_tokens == 0:  # nothing of the voted type (or the scheduler found nothing to run)
            self._dummy_step()
            stats.dummy_steps += 1
            if self.engine.eplb is not None:
                self.engine.eplb.recorder.end_step()  # keep every rank's load window on group steps
        else:
            stats.prefill_steps += self.sched.last_type == PREFILL
            stats.decode_steps += self.sched.last_type == DECODE
            stats.mismatched += self.sched.last_type != kind
        stats.steps += 1
        stats.tokens += num_tokens
        stats.forward_s += (time.perf_counter() - t) - (self.ep_stats.a2a_s - a2a)
        self.group_steps += 1
        if self.eplb_enabled and self.group_steps % self.engine.eplb.config.step_interval == 0:
            self._replan()
        return finished

    def _replan(self) -> None:
        """Plans on the group's load (all-reduced window) and moves expert weights across ranks."""
        from deepinfer.distributed.expert_transfer import exchange_experts
        from eplb.placement import ExpertPlacement, moe_lb_total
        from eplb.policy import rebalance_experts

        eplb, c = self.engine.eplb, self.engine.eplb.config
        load = self.group.all_reduce_sum(eplb.recorder.total().clone())
        old = eplb.placement.phy2log
        new = rebalance_experts(load, eplb.placement.num_physical, c.num_groups, c.num_nodes, self.world_size,
                                prev_phy2log=old)[0]
        written, received = exchange_experts([b.experts.slot_weights() for b in self.moe_blocks], old, new,
                                             self.rank, self.world_size, self.group.ep_group)
        eplb.placement = ExpertPlacement(new, self.world_size, eplb.placement.num_experts)
        self.num_replans += 1
        self.num_moved += written
        self.num_received += received
        logger.info("eplb replan at group step %d: moe_lb %.4f -> %.4f; %d slots rewritten here, %d from other "
                    "ranks", self.group_steps, moe_lb_total(load, old, self.world_size),
                    moe_lb_total(load, new, self.world_size), written, received)

    def eplb_state(self) -> dict:
        """Replans so far, slots rewritten / received on this rank, and the current phy2log [L, R]."""
        p = self.engine.eplb.placement if self.engine.eplb is not None else None
        return {"replans": self.num_replans, "moved": self.num_moved, "received": self.num_received,
                "phy2log": None if p is None else p.phy2log.tolist()}

    def _dummy_step(self) -> None:
        """A forward over zero tokens: every MoE layer joins its collectives, in model order."""
        for ep, experts in self.ep_layers:
            ep.dummy(experts)

    # Prefill gating: requests wait here until a PREFILL step admits them (see module docstring).
    def _budget(self) -> list:
        s = self.sched
        return [s.num_running, s.num_free_state_slots, s.block_manager.num_free_blocks, 0]

    def _fits(self, request, budget: list) -> bool:
        """Whether the C++ prefill would admit all of request's sequences now; updates budget."""
        ids, params = request[1], request[2]
        c, n = self.engine.config, 1 if len(request) > 4 else params.n  # a child is one sequence
        blocks = n * -(-len(ids) // c.block_size)
        running, slots, free_blocks, tokens = budget
        over_budget = tokens + n * len(ids) > c.max_num_batched_tokens and not self.engine.chunked_prefill
        if running + n > c.max_num_seqs or slots < n or free_blocks < blocks or over_budget:
            return False
        budget[:] = [running + n, slots - n, free_blocks - blocks, tokens + n * len(ids)]
        return True

    def has_prefill(self) -> bool:
        if self.sched.num_waiting or self.sched.can_prefill():  # the latter: a chunked prefill under way
            return True
        if not self.pending:
            return False
        # An idle engine always admits something (the C++ checks one max_model_len sequence fits).
        return self.sched.num_running == 0 or self._fits(self.pending[0], self._budget())

    def _admit(self) -> None:
        """Hands the C++ scheduler the queued requests it will admit in this prefill step."""
        if self.sched.num_waiting:
            return  # preempted sequences go first, the C++ FCFS order
        budget = self._budget()
        first = self.sched.num_running == 0
        while self.pending and (self._fits(self.pending[0], budget) or first):
            self.engine.add_request(*self.pending.popleft())
            first = False

    def window_load(self):
        """[W, L, E] this rank's recorded expert load (LLM.get_expert_load sums the ranks)."""
        return self.engine.eplb.recorder.window_load() if self.engine.eplb is not None else None

    def window_info(self) -> tuple[int, int]:
        """(window size, steps recorded) of this rank's expert-load recorder."""
        r = self.engine.eplb.recorder
        return r.window, r.steps

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
        self.group.destroy()


def _rank_config(config: EngineConfig, world_size: int) -> EngineConfig:
    """The rank's EngineConfig: its placement is planned for world_size expert-parallel ranks."""
    eplb = dict(config.eplb_config or {})
    if eplb.get("num_gpus", world_size) != world_size:
        raise ValueError(f"eplb_config num_gpus={eplb['num_gpus']} must equal data_parallel_size={world_size}")
    eplb["num_gpus"] = world_size
    return dataclasses.replace(config, eplb_config=eplb)


# ----------------------------------------------------------------------------------------------------
# front


class DPEngine:
    """k DP ranks behind LLMEngine's surface. Ray is started on 127.0.0.1 unless ray_address names a
    cluster to join (or Ray is already initialised); rank processes end with this object."""

    def __init__(self, config: EngineConfig, data_parallel_size: int, ray_address: str | None = None,
                 dp_config: dict | None = None):
        from deepinfer.distributed import ray_launch
        from deepinfer.distributed.channels import Receiver
        from deepinfer.distributed.process_groups import free_port
        from deepinfer.models.loader import load_tokenizer

        if not isinstance(data_parallel_size, int) or data_parallel_size < 2:
            raise ValueError(f"DPEngine needs data_parallel_size >= 2, got {data_parallel_size!r}")
        config.validate()
        self.dp, self.world_size = DPConfig.from_dict(dp_config), data_parallel_size
        self.hf_config = _hf_config(config.model)
        # The front's view; ranks fill in their own block size (the model decides what it must divide).
        self.config = dataclasses.replace(config)
        self.config.fill_defaults(self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.tokenizer = load_tokenizer(config.model)
        if getattr(config, "speculative", None):
            raise ValueError("LLM(speculative=...) is not supported with data_parallel_size > 1 yet")
        if config.engine_type != "normal":
            raise ValueError(f"LLM(engine_type={config.engine_type!r}) is not supported with data_parallel_size > 1; "
                             "DP ranks run engine_type='normal'")
        self.spec = None  # read by LLMEngine.validate_request
        self._grammars = None  # LLMEngine.grammar_compiler's cache
        self.balancer = DecodeBalancer(data_parallel_size)
        self._queued: list = []
        self._outstanding: dict[str, tuple[int, int]] = {}  # request_id -> (rank, kv length)
        self._session, self._session_done_at, self._failed = None, None, None
        self.last_stats: list[dict] = []
        owns_ray = ray_launch.ensure_ray(ray_address)
        self.receiver = Receiver()
        port = free_port()
        self.actors = ray_launch.start_actors(
            DPRankWorker, data_parallel_size,
            lambda r: (config, r, data_parallel_size, port, self.receiver.address, self.dp),
            self.dp.num_cpus_per_rank, self.dp.num_gpus_per_rank)
        self._finalizer = weakref.finalize(self, _shutdown, self.actors, self.receiver, owns_ray)
        self.rank_pids = self._wait_started()
        self.eplb = _GroupExpertLoad(self.actors) if self._has_moe() else None

    def _has_moe(self) -> bool:
        import ray

        return bool(ray.get(self.actors[0].local_slots.remote()))

    def _wait_started(self) -> list[int]:
        import ray

        try:
            return ray.get([a.pid.remote() for a in self.actors], timeout=self.dp.start_timeout_s)
        except Exception as exc:
            self._finalizer()
            raise RuntimeError(f"data-parallel ranks failed to start: {_summary(exc)}") from exc

    # LLMEngine's checks need only config, vocab_size and tokenizer, which the front has.
    validate_request = LLMEngine.validate_request
    _validate_processors = LLMEngine._validate_processors
    grammar_compiler = LLMEngine.grammar_compiler
    eos_token_ids = LLMEngine.eos_token_ids

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None,
                    rank: int | None = None) -> None:
        """Queues a request for the next session; rank pins it (tests), else the balancer decides."""
        if rank is not None and not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        self._queued.append(((request_id, list(prompt_token_ids), params, prompt), rank))

    def has_unfinished(self) -> bool:
        """Requests queued or running, or a session whose ranks have not returned yet (so the last
        step() of a generate collects the ranks' stats and the next one starts from a closed session)."""
        return bool(self._queued or self._outstanding or self._session is not None)

    def step(self) -> tuple[list, int]:
        """Starts a session when requests are queued and none runs, then returns the requests that
        finished within poll_ms (and 0: tokens are counted by the ranks)."""
        if self._failed:
            raise RuntimeError(self._failed)
        if self._session is None and self._queued:
            self._start_session()
        finished = []
        for rank, outs in self.receiver.recv(self.dp.poll_ms):
            for out in outs:
                if out.request_id in self._outstanding:  # else aborted before it arrived
                    self.balancer.release(*self._outstanding.pop(out.request_id))
                    finished.append(out)
        self._check_session()
        return finished, 0

    def _start_session(self) -> None:
        kv = [self._kv_len(req) for req, _ in self._queued]
        free = [i for i, (_, rank) in enumerate(self._queued) if rank is None]
        ranks = [rank for _, rank in self._queued]
        for i, r in zip(free, self.balancer.assign([kv[i] for i in free])):
            ranks[i] = r
        per_rank: list[list] = [[] for _ in range(self.world_size)]
        for i, ((req, pinned), r) in enumerate(zip(self._queued, ranks)):
            if pinned is not None:
                self.balancer.add(r, kv[i])
            per_rank[r].append(req)
            self._outstanding[req[0]] = (r, kv[i])
        self._queued = []
        self._session = [a.run_session.remote(reqs) for a, reqs in zip(self.actors, per_rank)]
        self._session_done_at = None

    def _kv_len(self, req) -> int:
        _, ids, params, _ = req
        return params.n * kv_at_end(len(ids), params.max_tokens, self.config.max_model_len)

    def _check_session(self) -> None:
        """Raises (and ends every rank) if a rank failed; closes the session once all ranks returned
        and every output arrived."""
        import ray

        if self._session is None:
            return
        ready, _ = ray.wait(self._session, num_returns=len(self._session), timeout=0)
        for ref in ready:
            rank = self._session.index(ref)
            try:
                ray.get(ref)
            except Exception as exc:
                self._fail(f"data-parallel rank {rank} failed: {_summary(exc)}", exc)
        if len(ready) < len(self._session):
            return
        if self._session_done_at is None:
            self._session_done_at = time.monotonic()
        if not self._outstanding:
            self.last_stats = ray.get(self._session)
            self._session = None
            for r, s in enumerate(self.last_stats):
                logger.info("dp rank %d: %d steps, %d dummy, %d prefill, %d decode", r, s["steps"],
                            s["dummy_steps"], s["prefill_steps"], s["decode_steps"])
        elif time.monotonic() - self._session_done_at > 10.0:
            self._fail(f"data-parallel ranks finished but {len(self._outstanding)} outputs never arrived", None)

    def _fail(self, message: str, cause) -> None:
        self._failed = message + " (the DP engine has been shut down)"
        self._session = None
        self._finalizer()
        raise RuntimeError(self._failed) from cause

    def abort_all(self) -> None:
        """After an exception in generate: a running session cannot be cut short consistently, so
        the ranks are ended; queued requests are dropped."""
        self._queued.clear()
        if self._session is not None and not self._failed:
            self._failed = "the DP engine was shut down after an interrupted generate"
            self._finalizer()
        self._session = None
        self._outstanding.clear()

    def shutdown(self) -> None:
        """Ends every rank process (and Ray, when this engine started it)."""
        self._finalizer()


class _GroupExpertLoad:
    """What LLM.get_expert_load / dump_expert_load read (engine.eplb.recorder) for a DP group: the
    ranks' load windows summed. Ranks close a window step on every group step, dummy ones included,
    so step i of every rank's window is the same group step."""

    def __init__(self, actors: list):
        self.actors = actors

    @property
    def recorder(self) -> "_GroupExpertLoad":
        return self

    def window_load(self):
        """[W, L, E] tokens per logical expert, summed over ranks, for the last W group steps."""
        import ray

        return sum(ray.get([a.window_load.remote() for a in self.actors]))

    def dump(self, path: str) -> None:
        """The .npz of ExpertLoadRecorder.dump, for `python -m eplb.replan`."""
        import numpy as np
        import ray

        load = self.window_load()
        window, steps = ray.get(self.actors[0].window_info.remote())
        np.savez(path, load=load.numpy(), num_layers=load.shape[1], num_experts=load.shape[2], window=window,
                 steps=steps)


def _shutdown(actors: list, receiver, owns_ray: bool) -> None:
    from deepinfer.distributed import ray_launch

    ray_launch.kill_actors(actors)
    receiver.close()
    if owns_ray:
        ray_launch.shutdown_ray()


def _hf_config(path: str):
    from deepinfer.models.loader import find_gguf, gguf_config, hf_dir_config

    gguf = find_gguf(path)
    return gguf_config(gguf) if gguf else hf_dir_config(path)


def _summary(exc: BaseException) -> str:
    """The exception's type and last message line (a RayTaskError's last line is the rank's error)."""
    text = str(exc).strip()
    lines = [l for l in text.splitlines() if l.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
