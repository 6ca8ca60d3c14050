"""Splits LLMEngine.step() time into schedule / input prep / forward / sampling / output processing
by wrapping the calls step() already makes (no change to what they do):

- draft:     engine.spec.prepare() when speculative decoding is on (drafting; 0 otherwise)
- schedule:  scheduler.schedule() (C++; it also builds the flat input arrays)
- prepare:   runner.prepare(): arrays -> torch tensors and attention metadata
- forward:   runner.execute() / runner.logits_all() minus prepare and the sampler (model forward, logits), or
             runner.draw() (a decode step drawn in the model's own call, decode_drawn: its draw too),
             or runner.decode_steps() (num_scheduler_steps > 1: a run of decode steps in one C++ call, greedy
             or sampled and drawn there, which also schedules and processes every step of the run after its first)
- sampling:  engine._sampling_batch() (per-row parameter tensors) plus runner.sampler(), or the
             draft verification (engine.spec.verify()) on speculative steps
- output:    the rest of step(): scheduler.process() (C++ append, stop checks, frees) and the
             Python per-sequence bookkeeping
"""
import time

PHASES = ("draft", "schedule", "prepare", "forward", "sampling", "output")


class _Timed:
    """Calls fn and adds its wall time to acc[key]."""

    def __init__(self, fn, acc: dict, key: str):
        self.fn, self.acc, self.key = fn, acc, key

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.acc[self.key] = self.acc.get(self.key, 0.0) + time.perf_counter() - t

    def __getattr__(self, name):  # e.g. the engine reads runner.sampler.sample
        return getattr(self.fn, name)


class _SchedulerProxy:
    """Stands in for the C++ Scheduler (whose attributes cannot be replaced): times schedule() and
    process(), remembers the last batch, forwards everything else."""

    def __init__(self, scheduler, acc: dict, timer: "StepTimer"):
        self._s, self._timer = scheduler, timer
        self._schedule, self.process = _Timed(scheduler.schedule, acc, "schedule"), _Timed(scheduler.process, acc, "process")

    def schedule(self, *args, **kwargs):  # e.g. schedule(want): the DP group's voted step type
        batch = self._schedule(*args, **kwargs)
        self._timer.last_batch = batch
        return batch

    def __getattr__(self, name):
        return getattr(self._s, name)


class StepTimer:
    """Use as a context manager around an engine; step() returns (batch, {phase: seconds})."""

    def __init__(self, engine):
        self.engine, self.acc, self.last_batch = engine, {}, None

    def __enter__(self):
        e, r = self.engine, self.engine.runner
        self._saved = (e.scheduler, r.sampler)
        e.scheduler = _SchedulerProxy(e.scheduler, self.acc, self)
        # Instance attributes shadow the methods; the originals stay bound to the same objects.
        r.prepare = _Timed(type(r).prepare.__get__(r), self.acc, "prepare")
        r.execute = _Timed(type(r).execute.__get__(r), self.acc, "execute")
        r.draw = _Timed(type(r).draw.__get__(r), self.acc, "draw")
        r.decode_steps = _Timed(type(r).decode_steps.__get__(r), self.acc, "decode_steps")
        r.sampler = _Timed(r.sampler, self.acc, "sampler")
        e._sampling_batch = _Timed(type(e)._sampling_batch.__get__(e), self.acc, "sampling_batch")
        self._wrapped = [(r, "prepare"), (r, "execute"), (r, "draw"), (r, "decode_steps"), (e, "_sampling_batch")]
        spec = getattr(e, "spec", None)  # speculative decoding, where the engine has it
        for obj, name, key in ((r, "logits_all", "logits_all"), (spec, "prepare", "draft"), (spec, "verify", "verify")):
            if obj is not None and hasattr(type(obj), name):
                setattr(obj, name, _Timed(getattr(type(obj), name).__get__(obj), self.acc, key))
                self._wrapped.append((obj, name))
        return self

    def __exit__(self, *exc):
        e, r = self.engine, self.engine.runner
        e.scheduler, r.sampler = self._saved
        for obj, name in self._wrapped:
            obj.__dict__.pop(name, None)

    def step(self):
        """One engine step. Returns (step outputs, batch, phase seconds)."""
        self.acc.clear()
        t = time.perf_counter()
        out = self.engine.step()
        total = time.perf_counter() - t
        return out, self.last_batch, split(total, self.acc)


def split(total: float, acc: dict) -> dict:
    """Phase seconds from the wrapped calls' times; output is the remainder, so phases sum to total."""
    g = acc.get
    phases = {"draft": g("draft", 0.0), "schedule": g("schedule", 0.0), "prepare": g("prepare", 0.0),
              "forward": g("execute", 0.0) + g("logits_all", 0.0) + g("draw", 0.0) + g("decode_steps", 0.0)
              - g("prepare", 0.0) - g("sampler", 0.0),
              "sampling": g("sampling_batch", 0.0) + g("sampler", 0.0) + g("verify", 0.0)}
    phases["output"] = total - sum(phases.values())
    phases["total"] = total
    return phases
