"""Disaggregated prefill and decode: n_p PROMPT engines and n_d COMPLETION engines, each a Ray actor (its own
process), behind LLMEngine's surface.

The front (`DisaggEngine`, in the caller's process) splits each request into its params.n children and
sends each child to a prefill engine (`PrefillBalancer`: context tier, then queued prompt tokens), naming
the decode engine that will finish it (`DecodeBalancer`: running requests and total KV length), so the KV
goes prefill -> decode directly over pyzmq (zero-copy frames, engine/kv_transfer.py) and never through the
front. Engines report to the front on one channel: "prefilled" (first token drawn, KV sent), "received" (the handoff
reached the decode engine), "imported", "finished". A request's prompt_logprobs are scored by the prefill engine and
travel to the front with its "prefilled" (or "finished", when it ends at its prefill) report. Ray only places and
supervises the processes. With prefill_dp / decode_dp = k > 1 each engine is a DP group of k rank processes (DP
attention, expert-parallel MoE, one voted step type per step, as in engine/dp.py); the balancers then see ranks,
since each rank holds its own requests, KV and queue.

Faults: an engine that dies is noticed from its serve() call (a DP group dies whole: its other ranks are ended too);
its unfinished children are prefilled again on survivors (a decode engine's KV is gone with it). A handoff not
received within transfer_timeout_s (a connection cut mid-transfer loses the message) is prefilled again. Every try
has its own key, so a late message of an abandoned try is ignored (and the engine holding it is told to abort it):
each output is returned once. With no prefill or decode engine left, step() raises."""
import dataclasses
import logging
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from deepinfer.config import STATE_TRANSFER_MODES, EngineConfig, dataclass_from_dict
from deepinfer.engine.balancers import DecodeBalancer, PrefillBalancer, kv_at_end
from deepinfer.engine.dp import DPConfig, _hf_config, _summary
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput

logger = logging.getLogger("deepinfer")

PREFILL, DECODE = "prefill", "decode"


@dataclass
class DisaggConfig:
    """LLM(disaggregation=...) keys."""

    prefill: int = 1                    # PROMPT engines
    decode: int = 1                     # COMPLETION engines
    prefill_dp: int = 1                 # ranks per prefill engine: > 1 makes each a DP group (EP MoE, engine/dp.py)
    decode_dp: int = 1                  # ranks per decode engine
    dp_config: dict | None = None       # a DP group's DPConfig keys (vote intervals, collective timeout)
    state_transfer: str = "auto"        # a handoff's StateBlock: "state", "replay" or whichever moves fewer bytes
    num_cpus_per_engine: float = 0.5    # Ray resources; fractional so engines share a small machine
    num_gpus_per_engine: float = 0.0
    transfer_timeout_s: float = 30.0    # prefilled but not received by the decode engine by then: prefill again
    max_attempts: int = 3               # tries per request child before it ends with finish_reason "error"
    start_timeout_s: float = 300.0
    poll_ms: int = 20                   # how long one front step() or idle engine waits for messages

    @classmethod
    def from_dict(cls, d: dict | None) -> "DisaggConfig":
        cfg = dataclass_from_dict(cls, d, "disaggregation")
        for name in ("prefill", "decode", "prefill_dp", "decode_dp", "max_attempts", "poll_ms"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LLM(disaggregation={{{name!r}: {value!r}}}) must be a positive integer")
        if cfg.state_transfer not in STATE_TRANSFER_MODES:
            raise ValueError(f"LLM(disaggregation={{'state_transfer': {cfg.state_transfer!r}}}) must be one of "
                             f"{STATE_TRANSFER_MODES}")
        DPConfig.from_dict(cfg.dp_config)  # refuses unknown keys now, not in the engine processes
        return cfg

    def group_size(self, role: str) -> int:
        return self.prefill_dp if role == PREFILL else self.decode_dp


# ----------------------------------------------------------------------------------------------------
# engine process


class EngineWorker:
    """One PROMPT or COMPLETION engine in its own process, fed through its inbox; or one rank of such an
    engine when it is a DP group (group = (rank, world_size, port, DPConfig)): then the ranks vote on every
    step as DP ranks do (engine/dp.py), a rank without work of the voted type runs a dummy step, and they
    agree through the vote on when to stop.

    Inbox messages: ("prefill", key, prompt_ids, params, (index, seed), decode_address), ("handoff", Handoff),
    ("abort", key), ("stop",). To the front: (role, index, event, key, payload)."""

    def __init__(self, config: EngineConfig, role: str, index: int, front_address: str, poll_ms: int,
                 group: tuple | None = None):
        from deepinfer.distributed.channels import Receiver, Sender

        config = dataclasses.replace(config, engine_type="prompt" if role == PREFILL else "completion")
        if group is None:
            self.rank, self.engine = None, LLMEngine(config)
        else:
            from deepinfer.engine.dp import DPRankWorker, RankStats

            rank, world_size, port, dp = group
            self.rank, self.rank_stats = DPRankWorker(config, rank, world_size, port, None, dp), RankStats()
            self.engine = self.rank.engine
        self.role, self.index, self.poll_ms = role, index, poll_ms
        self.inbox, self.front = Receiver(), Sender(front_address)
        self.peers: dict[str, Sender] = {}  # decode inboxes this prefill engine sent to
        self.targets: dict[str, str] = {}   # key -> decode address (prefill)
        self.waiting: deque = deque()       # handoffs waiting for blocks (decode)
        self.aborted: set[str] = set()      # keys the front gave up on: their late handoffs are dropped
        self.group_busy = False             # the group's last vote saw work (DP group only)
        self.stats = {"steps": 0, "handoffs": 0, "bytes_sent": 0, "imported": 0}

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> str:
        return self.inbox.address

    def engine_config(self) -> EngineConfig:
        """The config with the engine's defaults filled in (block size, lengths)."""
        return self.engine.config

    def serve(self) -> dict:
        """Runs until ("stop",): messages in, engine steps, events out. Returns the engine's counters."""
        stopping = False
        while True:
            busy = self.engine.has_unfinished() or bool(self.waiting) or self.group_busy
            for msg in self.inbox.recv(0 if busy else self.poll_ms):
                stopping = stopping or msg[0] == "stop"
                if msg[0] != "stop":
                    self._handle(msg)
            self._import_waiting()
            if self.rank is not None:
                if self._group_step(stopping):
                    return self._final_stats()
            elif stopping:
                return self._final_stats()
            elif self.engine.has_unfinished():
                self._publish(self.engine.step()[0])

    def _group_step(self, stopping: bool) -> bool:
        """One vote of the DP group, then the voted step (or a dummy one). True when the group stops."""
        r = self.rank
        has_prefill, has_decode = r.has_prefill(), r.sched.num_running > 0
        num_prefill, num_decode, num_stopping = r.group.vote(has_prefill, has_decode, stopping)
        if num_stopping:
            return True
        kind = r.vote.decide(num_prefill, num_decode, r.world_size)
        self.group_busy = kind is not None
        if kind is not None:
            self._publish(r.step(kind, has_prefill, has_decode, self.rank_stats))
        return False

    def _final_stats(self) -> dict:
        if self.engine.prefix_cache is not None:
            self.stats["prefix_cache"] = self.engine.prefix_cache.store.stats()
        return self.stats

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "prefill":
            _, key, prompt_ids, params, child, decode_address = msg
            self.targets[key] = decode_address
            if self.rank is None:
                self.engine.add_request(key, prompt_ids, params, None, child)
            else:  # a DP rank admits it on a PREFILL step the group voted for
                self.rank.pending.append((key, prompt_ids, params, None, child))
        elif kind == "handoff":  # acknowledged now: an import may wait for free blocks, not for a retry
            if msg[1].request_id not in self.aborted:  # else a try the front gave up on arrived late
                self.waiting.append(msg[1])
                self._emit("received", msg[1].request_id, None)
        elif kind == "abort":
            key = msg[1]
            self.aborted.add(key)
            self.engine.abort_request(key)
            self.targets.pop(key, None)
            self.waiting = deque(h for h in self.waiting if h.request_id != key)
            if self.rank is not None:
                self.rank.pending = deque(r for r in self.rank.pending if r[0] != key)

    def _import_waiting(self) -> None:
        """Admits waiting handoffs in arrival order while the pools have room."""
        while self.waiting and self.engine.import_handoff(self.waiting[0]):
            self._emit("imported", self.waiting.popleft().request_id, None)
            self.stats["imported"] += 1

    def _publish(self, finished: list) -> None:
        """After a step: sends the handoffs it made to their decode engines, and reports the requests that
        ended here (a decoded one, or one done at its prefill: EOS or max_tokens=1), each with the prompt logprobs
        this engine scored for it (None on a decode engine, or where not wanted)."""
        self.stats["steps"] += 1
        scored = {out.request_id: out.prompt_logprobs for out in finished}
        for h in self.engine.handoffs:
            self._send_handoff(h, scored.get(h.request_id))
        self.engine.handoffs.clear()
        for out in finished:
            if out.outputs[0].finish_reason != "handoff":
                self.targets.pop(out.request_id, None)
                self._emit("finished", out.request_id, (out.outputs[0], out.prompt_logprobs))

    def _send_handoff(self, h, prompt_logprobs: list | None) -> None:
        from deepinfer.distributed.channels import Sender

        address = self.targets.pop(h.request_id)
        if address not in self.peers:
            self.peers[address] = Sender(address)
        wire = self.peers[address].send(("handoff", h))
        self.stats["handoffs"] += 1
        self.stats["bytes_sent"] += wire
        self._emit("prefilled", h.request_id, {"kv_bytes": h.kv_bytes, "wire_bytes": wire,
                                               "replay_tokens": h.replay_tokens, "prompt_logprobs": prompt_logprobs})

    def _emit(self, event: str, key: str, payload) -> None:
        self.front.send((self.role, self.index, event, key, payload))


# ----------------------------------------------------------------------------------------------------
# front


@dataclass
class Child:
    """One of a request's params.n sequences, as the front tracks it across tries."""

    request: "Pending"
    index: int
    seed: int
    attempt: int = 0
    key: str = ""
    stage: str = PREFILL  # prefill -> transfer -> received -> decode
    prefill: int = -1
    decode: int = -1
    sent_at: float = 0.0
    output: CompletionOutput | None = None


@dataclass
class Pending:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object
    metrics: RequestMetrics
    children: list[Child] = field(default_factory=list)
    kv_len: int = 0  # KV one child holds at its end (what the decode balancer evens out)
    prompt_logprobs: list | None = None  # as the first prefill to finish scored them (every child's try scores)


class DisaggEngine:
    """Prefill and decode engines behind LLMEngine's surface. Ray is started on 127.0.0.1 unless
    ray_address names a cluster (or Ray is already initialised); engine processes end with this object."""

    def __init__(self, config: EngineConfig, disaggregation: dict, ray_address: str | None = None):
        from deepinfer.distributed.channels import Receiver
        from deepinfer.models.loader import load_tokenizer

        config.validate()
        self.cfg = DisaggConfig.from_dict(disaggregation)
        if config.speculative:
            raise ValueError("LLM(speculative=...) is not supported with disaggregation yet: the MTP drafter "
                             "needs the prefill's last hidden state, which no handoff carries")
        if config.engine_type != "normal":
            raise ValueError(f"LLM(engine_type={config.engine_type!r}) conflicts with disaggregation, which "
                             "starts its own prompt and completion engines")
        # Engines fill in their own defaults (the model decides the block size); the front adopts theirs.
        self.config = dataclasses.replace(config, state_transfer=self.cfg.state_transfer)
        self.hf_config = _hf_config(config.model)
        self.vocab_size, self.tokenizer = self.hf_config.vocab_size, load_tokenizer(config.model)
        self.spec, self.eplb, self._grammars = None, None, None  # read by LLM and validate_request
        # Each rank of a DP-group engine has its own requests, KV and queue: the balancers see ranks.
        self.num_ranks = {PREFILL: self.cfg.prefill * self.cfg.prefill_dp, DECODE: self.cfg.decode * self.cfg.decode_dp}
        self.decode_balancer = DecodeBalancer(self.num_ranks[DECODE])
        self.pending: dict[str, Pending] = {}
        self.by_key: dict[str, Child] = {}
        self.finished: list[RequestOutput] = []
        self.stats = {"transfers": 0, "kv_bytes": 0, "wire_bytes": 0, "replayed": 0, "retries": 0}
        self._start(ray_address, Receiver())

    def _start(self, ray_address: str | None, receiver) -> None:
        import ray

        from deepinfer.distributed import ray_launch
        from deepinfer.distributed.channels import Sender

        owns_ray = ray_launch.ensure_ray(ray_address)
        self.receiver = receiver
        self.actors = {}
        for role in (PREFILL, DECODE):
            started = ray_launch.start_actors(EngineWorker, self.num_ranks[role], self._worker_args(role, receiver),
                                              self.cfg.num_cpus_per_engine, self.cfg.num_gpus_per_engine)
            self.actors.update({(role, i): a for i, a in enumerate(started)})
        channels = [receiver]  # the senders join once the engines' addresses are known
        self._finalizer = weakref.finalize(self, _shutdown, list(self.actors.values()), channels, owns_ray)
        try:
            names = list(self.actors)
            addresses = ray.get([self.actors[n].address.remote() for n in names], timeout=self.cfg.start_timeout_s)
        except Exception as exc:
            self._finalizer()
            raise RuntimeError(f"disaggregated engines failed to start: {_summary(exc)}") from exc
        self.addresses = dict(zip(names, addresses))
        self.config = ray.get(self.actors[names[0]].engine_config.remote())
        self.prefill_balancer = PrefillBalancer(self.num_ranks[PREFILL], self.config.max_model_len)
        # Where prefill engines send KV: tests point an entry at a proxy to cut a transfer.
        self.decode_addresses = [self.addresses[(DECODE, i)] for i in range(self.num_ranks[DECODE])]
        self.senders = {n: Sender(a) for n, a in self.addresses.items()}
        channels.extend(self.senders.values())
        self.serving = {n: self.actors[n].serve.remote() for n in names}
        self.alive = {role: set(range(n)) for role, n in self.num_ranks.items()}

    def _worker_args(self, role: str, receiver):
        """rank index -> EngineWorker arguments; ranks of one DP group share a process-group port."""
        from deepinfer.distributed.process_groups import free_port

        k = self.cfg.group_size(role)
        ports = [free_port() for _ in range(self.num_ranks[role] // k)]
        dp = DPConfig.from_dict(self.cfg.dp_config)

        def args(i: int) -> tuple:
            group, rank = divmod(i, k)
            return (self.config, role, i, receiver.address, self.cfg.poll_ms,
                    (rank, k, ports[group], dp) if k > 1 else None)
        return args

    # LLMEngine's checks need only config, vocab_size and tokenizer, which the front has.
    validate_request = LLMEngine.validate_request
    _validate_processors = LLMEngine._validate_processors
    grammar_compiler = LLMEngine.grammar_compiler
    eos_token_ids = LLMEngine.eos_token_ids
    sequence_seed = LLMEngine.sequence_seed

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None) -> None:
        if request_id in self.pending:
            raise ValueError(f"request {request_id!r} is already running")
        req = Pending(request_id, prompt, list(prompt_token_ids), params,
                      RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(prompt_token_ids)),
                      kv_len=kv_at_end(len(prompt_token_ids), params.max_tokens, self.config.max_model_len))
        req.children = [Child(req, i, self.sequence_seed(request_id, params, i)) for i in range(params.n)]
        self.pending[request_id] = req
        for child in req.children:
            self._dispatch(child)

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.finished)

    def step(self) -> tuple[list[RequestOutput], int]:
        """Handles what the engines reported within poll_ms; returns the requests finished meanwhile (and 0:
        tokens are counted by the engines)."""
        for role, index, event, key, payload in self.receiver.recv(self.cfg.poll_ms):
            child = self.by_key.get(key)
            if child is not None:  # else a try given up on: ignored
                getattr(self, f"_on_{event}")(child, payload)
        self._check_engines()
        self._check_transfers()
        done, self.finished = self.finished, []
        return done, 0

    # ---- routing ----------------------------------------------------------------------------------------

    def _dispatch(self, child: Child) -> None:
        """Sends a child (again) to a prefill engine, naming its decode engine; ends it with an error after
        max_attempts tries."""
        req = child.request
        self.by_key.pop(child.key, None)
        if child.attempt >= self.cfg.max_attempts:
            self._finish(child, CompletionOutput(child.index, "", [], None, None, "error",
                                                 error=f"request {req.request_id!r}: gave up after "
                                                       f"{child.attempt} tries (engines died or transfers timed out)"))
            return
        child.attempt += 1
        child.key = f"{req.request_id}/{child.index}/{child.attempt}"
        child.stage = PREFILL
        child.prefill = self.prefill_balancer.pick(len(req.prompt_token_ids), self._alive(PREFILL))
        child.decode = self.decode_balancer.pick(req.kv_len, self._alive(DECODE))
        self.by_key[child.key] = child
        self.senders[(PREFILL, child.prefill)].send(
            ("prefill", child.key, req.prompt_token_ids, req.params, (child.index, child.seed),
             self.decode_addresses[child.decode]))

    def _alive(self, role: str) -> set[int]:
        if not self.alive[role]:
            raise RuntimeError(f"disaggregation: no {role} engine is left; {len(self.pending)} requests unfinished")
        return self.alive[role]

    def _retry(self, child: Child) -> None:
        """Abandons a child's current try (its engines are told to drop it) and dispatches it again."""
        self.stats["retries"] += 1
        self._abort(child)
        self._dispatch(child)

    def _abort(self, child: Child) -> None:
        """Tells the live engines of a child's try to drop it, and frees its balancer loads."""
        for role, i in ((PREFILL, child.prefill), (DECODE, child.decode)):
            if i in self.alive[role]:
                self.senders[(role, i)].send(("abort", child.key))
        self._release(child)

    def _release(self, child: Child) -> None:
        if child.stage == PREFILL:
            self.prefill_balancer.done(child.prefill, len(child.request.prompt_token_ids))
        self.decode_balancer.release(child.decode, child.request.kv_len)

    # ---- events -----------------------------------------------------------------------------------------

    def _on_prefilled(self, child: Child, info: dict) -> None:
        self._keep_prompt_logprobs(child.request, info["prompt_logprobs"])
        self.prefill_balancer.done(child.prefill, len(child.request.prompt_token_ids))
        child.stage, child.sent_at = "transfer", time.monotonic()
        metrics = child.request.metrics
        metrics.first_token_time = metrics.first_token_time or child.sent_at
        self.stats["transfers"] += 1
        self.stats["kv_bytes"] += info["kv_bytes"]
        self.stats["wire_bytes"] += info["wire_bytes"]
        self.stats["replayed"] += info["replay_tokens"] > 0

    def _on_received(self, child: Child, _) -> None:
        child.stage = "received"  # on the decode engine, waiting for blocks: no longer a transfer to time out

    def _on_imported(self, child: Child, _) -> None:
        child.stage = DECODE

    def _on_finished(self, child: Child, payload: tuple) -> None:
        out, prompt_logprobs = payload
        self._keep_prompt_logprobs(child.request, prompt_logprobs)
        self._release(child)
        self.by_key.pop(child.key)
        self._finish(child, out)

    @staticmethod
    def _keep_prompt_logprobs(req: Pending, prompt_logprobs: list | None) -> None:
        if req.prompt_logprobs is None:
            req.prompt_logprobs = prompt_logprobs

    def _finish(self, child: Child, out: CompletionOutput) -> None:
        child.output = out
        req = child.request
        if req.metrics.first_token_time is None and out.token_ids:
            req.metrics.first_token_time = time.monotonic()
        if all(c.output is not None for c in req.children):
            del self.pending[req.request_id]
            req.metrics.finished_time = time.monotonic()
            req.metrics.num_generation_tokens = sum(len(c.output.token_ids) for c in req.children)
            outputs = [c.output for c in req.children]
            self.finished.append(RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, True,
                                               req.metrics, req.prompt_logprobs))

    # ---- faults -----------------------------------------------------------------------------------------

    def _check_engines(self) -> None:
        """An engine whose serve() returned or raised is dead, and with it every rank of its DP group (the
        others would wait in a collective): the group's unfinished children go again."""
        import ray

        refs = {ref: name for name, ref in self.serving.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            role, i = refs[ref]
            if (role, i) not in self.serving:
                continue  # its group was already taken down
            logger.warning("disaggregation: %s engine rank %d died: %s", role, i, _outcome(ref))
            k = self.cfg.group_size(role)
            group = range(i // k * k, i // k * k + k)
            for rank in group:
                if self.serving.pop((role, rank), None) is not None and rank != i:
                    ray.kill(self.actors[(role, rank)], no_restart=True)
                self.alive[role].discard(rank)
            lost = [c for c in self.by_key.values()
                    if (role == PREFILL and c.prefill in group and c.stage == PREFILL)
                    or (role == DECODE and c.decode in group)]
            self._alive(role)
            for child in lost:
                self._retry(child)

    def _check_transfers(self) -> None:
        now = time.monotonic()
        late = [c for c in self.by_key.values()
                if c.stage == "transfer" and now - c.sent_at > self.cfg.transfer_timeout_s]
        for child in late:
            logger.warning("disaggregation: %s did not reach its decode engine within %.0f s; prefilling it again",
                           child.key, self.cfg.transfer_timeout_s)
            self._retry(child)

    def abort_all(self) -> None:
        """After an exception in generate: every running child is aborted on its engines."""
        for child in self.by_key.values():
            self._abort(child)
        self.by_key.clear()
        self.pending.clear()
        self.finished.clear()

    def shutdown(self) -> dict:
        """Stops every live engine, then ends the processes (and Ray, when this engine started it). Returns
        each stopped engine's counters by (role, index): steps, handoffs, bytes_sent, imported."""
        import ray

        for name in self.serving:
            self.senders[name].send(("stop",))
        try:
            stats = dict(zip(self.serving, ray.get(list(self.serving.values()), timeout=30)))
        except Exception as exc:  # a stuck or dead engine: killed below all the same
            logger.warning("disaggregation: engines did not stop cleanly: %s", _summary(exc))
            stats = {}
        self.serving.clear()
        self._finalizer()
        return stats


def _shutdown(actors: list, channels: list, owns_ray: bool) -> None:
    from deepinfer.distributed import ray_launch

    ray_launch.kill_actors(actors)
    for channel in channels:
        channel.close()
    if owns_ray:
        ray_launch.shutdown_ray()


def _outcome(ref) -> str:
    import ray

    try:
        return f"returned {ray.get(ref)}"
    except Exception as exc:
        return _summary(exc)

