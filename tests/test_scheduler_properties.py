"""Property tests: random add / schedule / process / finish / preempt / fork / sibling sequences through the C++
core never leak or double-free blocks, keep reference counts consistent and lose no request."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import _C

EOS = 1


def make_scheduler(num_blocks, block_size, max_num_seqs, engine_type=_C.EngineType.NORMAL, max_model_len=48,
                   budget=64, chunked=True, threshold=0):
    c = _C.SchedulerConfig()
    c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len = max_num_seqs, budget, max_model_len
    c.chunked_prefill, c.long_prefill_token_threshold = chunked, threshold
    c.block_size, c.num_blocks, c.num_state_slots = block_size, num_blocks, max_num_seqs
    c.engine_type, c.eos_token_ids = engine_type, [EOS]
    return _C.Scheduler(c)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 20), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(0, 10_000), st.booleans(), st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 10_000), st.booleans()),
    st.tuples(st.just("fork"), st.integers(0, 10_000), st.integers(2, 50)),
), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ops=ops, num_blocks=st.integers(24, 60), block_size=st.sampled_from([2, 4, 16]),
       max_num_seqs=st.integers(1, 6), budget=st.sampled_from([1, 5, 16, 64]), threshold=st.sampled_from([0, 3]))
def test_random_traces_keep_invariants(ops, num_blocks, block_size, max_num_seqs, budget, threshold):
    """Chunked prefill included: budgets below the prompt lengths, and a per-sequence cap; prefix-store hits (whole
    cached blocks short of the last prompt token); beam-search forks (a fork the sequence's state or the pool
    does not allow is refused, changing nothing) and parallel sampling's siblings (started from a prompt computed in
    the step, or waiting to recompute where there is no room), whose shared blocks then meet preemption and
    finishes."""
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget=budget, threshold=threshold)
    live, finished, next_id = {}, {}, 0
    for op in ops:
        if op[0] == "add":
            cached = min(op[3], (op[1] - 1) // block_size) * block_size
            sched.add_sequence(next_id, [7] * op[1], _C.SamplingLimits(op[2]), cached)
            live[next_id], next_id = op[2], next_id + 1
        elif op[0] == "step":
            _step(sched, live, finished, eos_seed=op[1] if op[2] else None, siblings=op[3], next_id=next_id)
            next_id = max([next_id] + [s + 1 for s in list(live) + list(finished)])
        elif op[0] == "fork" and live:
            parent = sorted(live)[op[1] % len(live)]
            before = (sched.block_manager.num_free_blocks, sched.num_running, sched.num_free_state_slots)
            try:
                sched.fork(parent, next_id, op[2])
            except ValueError:  # not between steps with a drawn token, or no room
                assert (sched.block_manager.num_free_blocks, sched.num_running, sched.num_free_state_slots) == before
            else:
                assert sched.sequence(next_id).token_ids[-1] == op[2]
                live[next_id], next_id = live[parent], next_id + 1
        elif live:
            victim = sorted(live)[op[1] % len(live)]
            sched.finish(victim, _C.FinishReason.ABORT)
            finished[victim] = "abort"
            del live[victim]
        sched.check_invariants()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        _step(sched, live, finished, eos_seed=None)
    assert not live and sorted(finished) == list(range(next_id))
    assert sched.block_manager.num_free_blocks == num_blocks
    assert sched.num_free_state_slots == max_num_seqs
    sched.check_invariants()


def _step(sched, live, finished, eos_seed, siblings=0, next_id=0):
    """One schedule and process; siblings: how many siblings each prompt completed in the step gets, as ids from
    next_id on."""
    batch = sched.schedule()
    if batch.type == _C.StepType.IDLE:
        assert not sched.has_unfinished()
        return
    assert all(s in live for s in batch.seq_ids)
    assert len(set(batch.seq_ids)) == len(batch.seq_ids) <= sched.num_running
    for s, drawn, ctx in zip(batch.seq_ids, batch.sampled, batch.context_lens):
        assert drawn == (ctx == sched.sequence(s).num_tokens), "a token is drawn exactly at a sequence's end"

    def draw(s):
        return EOS if eos_seed is not None and (eos_seed + s) % 3 == 0 else 9

    outs = []
    for s, drawn in zip(batch.seq_ids, batch.sampled):
        for _ in range(siblings if drawn and sched.sequence(s).num_output_tokens == 0 else 0):
            out, _ = sched.add_sibling(s, next_id, draw(next_id))
            assert out.seq_id == next_id and list(out.tokens) == [draw(next_id)]
            live[next_id], next_id = live[s], next_id + 1
            outs.append(out)
    tokens = [draw(s) for s, drawn in zip(batch.seq_ids, batch.sampled) if drawn]
    for out in sched.process(batch, tokens) + outs:
        if out.finished:
            assert out.seq_id not in finished, "a request finished twice"
            finished[out.seq_id] = out.reason
            del live[out.seq_id]


def test_decode_preempts_longest_output_and_recomputes():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_model_len=16)
    for sid in range(2):
        sched.add_sequence(sid, [3] * 3, _C.SamplingLimits(20))
    batch = sched.schedule()
    assert batch.type == _C.StepType.PREFILL and list(batch.seq_ids) == [0, 1]
    sched.process(batch, [9, 9])
    for step in range(6):
        batch = sched.schedule()
        if list(batch.preempted):
            break
        sched.process(batch, [9] * batch.num_seqs)
    assert list(batch.preempted) == [1], "the later (longest-output on ties: last) sequence is evicted"
    assert sched.sequence(1).num_computed_tokens == 0 and sched.num_waiting == 1
    sched.check_invariants()


def test_prefill_respects_token_budget_and_fcfs():
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=8, chunked=False)
    for sid, n in enumerate([30, 30, 5]):
        sched.add_sequence(sid, [3] * n, _C.SamplingLimits(4))
    batch = sched.schedule()
    assert list(batch.seq_ids) == [0, 1] and batch.num_tokens == 60
    assert list(batch.query_start_loc) == [0, 30, 60]
    assert list(batch.positions[:3]) == [0, 1, 2]


def test_chunked_prefill_fills_the_budget_and_continues_oldest_first():
    """Budget 64: two whole prompts and a 4-token chunk of the third (not drawn from); the next prefill step
    continues it before admitting a newer one, and its last chunk is drawn from."""
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=8)
    for sid, n in enumerate([30, 30, 9]):
        sched.add_sequence(sid, [3] * n, _C.SamplingLimits(4))
    batch = sched.schedule()
    assert list(batch.seq_ids) == [0, 1, 2] and batch.num_tokens == 64 and list(batch.sampled) == [1, 1, 0]
    assert list(batch.positions[60:]) == [0, 1, 2, 3] and list(batch.context_lens) == [30, 30, 4]
    assert [len(o.tokens) for o in sched.process(batch, [9, 9])] == [1, 1, 0]
    sched.add_sequence(3, [3] * 2, _C.SamplingLimits(4))
    batch = sched.schedule()
    assert batch.type == _C.StepType.PREFILL and list(batch.seq_ids) == [2, 3] and list(batch.sampled) == [1, 1]
    assert list(batch.positions[:5]) == [4, 5, 6, 7, 8]


def test_long_prefill_threshold_lets_a_short_prompt_in_beside_a_long_one():
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=8, threshold=8)
    sched.add_sequence(0, [3] * 40, _C.SamplingLimits(4))
    sched.add_sequence(1, [3] * 5, _C.SamplingLimits(4))
    batch = sched.schedule()
    assert list(batch.seq_ids) == [0, 1] and list(batch.query_start_loc) == [0, 8, 13]
    assert list(batch.sampled) == [0, 1]
    sched.process(batch, [9])
    assert sched.schedule().type == _C.StepType.PREFILL, "the long prompt's next chunk before the decode"


def test_cached_prefix_starts_prefill_after_it_and_preemption_recomputes_all():
    import pytest

    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=2)
    sched.add_sequence(0, list(range(2, 13)), _C.SamplingLimits(30), num_cached_tokens=8)
    batch = sched.schedule()
    assert batch.positions.tolist() == [8, 9, 10] and batch.context_lens.tolist() == [11]
    assert len(sched.sequence(0).block_table) == 3  # the cached prefix's blocks are the sequence's own
    sched.process(batch, [5])
    for _ in range(3):
        sched.process(sched.schedule(), [5])
    # a second sequence fills the pool; decode preempts the longest output, sequence 0
    sched.add_sequence(1, [3] * 30, _C.SamplingLimits(30))
    for _ in range(40):
        batch = sched.schedule()
        if 0 in batch.preempted:
            break
        sched.process(batch, [5] * int(batch.sampled.sum()))
    assert 0 in batch.preempted
    while True:  # the preempted sequence prefills again from token 0: its blocks were freed
        sched.process(batch, [5] * int(batch.sampled.sum()))
        batch = sched.schedule()
        if 0 in list(batch.seq_ids) and batch.type == _C.StepType.PREFILL:
            break
    i = list(batch.seq_ids).index(0)
    assert batch.positions[batch.query_start_loc[i]] == 0
    for bad in (3, 12, 11):  # not whole blocks; the whole prompt; past it
        with pytest.raises(ValueError, match="cached prefix"):
            sched.add_sequence(9, list(range(2, 14)), _C.SamplingLimits(3), num_cached_tokens=bad)


def test_block_manager_refcounts():
    bm = _C.BlockManager(4, 16)
    blocks = bm.allocate(3)
    bm.incref(blocks[:1])
    bm.free(blocks)
    assert bm.num_free_blocks == 3 and bm.ref_count(blocks[0]) == 1
    bm.free(blocks[:1])
    assert bm.num_free_blocks == 4
    bm.check()
    try:
        bm.free(blocks[:1])
        raise AssertionError("double free accepted")
    except ValueError as e:
        assert "double free" in str(e)


def test_prompt_engine_hands_off_and_completion_imports():
    prompt = make_scheduler(20, 4, 2, _C.EngineType.PROMPT)
    prompt.add_sequence(0, [3] * 6, _C.SamplingLimits(5))
    batch = prompt.schedule()
    (out,) = prompt.process(batch, [9])
    assert out.finished and out.reason == _C.FinishReason.HANDOFF
    seq = prompt.sequence(0)
    assert seq.status == _C.SequenceStatus.HANDED_OFF and len(seq.block_table) == 2
    prompt.release(0)
    assert prompt.block_manager.num_free_blocks == 20
    completion = make_scheduler(20, 4, 2, _C.EngineType.COMPLETION)
    assert completion.import_sequence(5, list(seq.token_ids), 6, _C.SamplingLimits(5))
    batch = completion.schedule()
    assert batch.type == _C.StepType.DECODE and list(batch.positions) == [6]


def test_forced_step_types_for_the_dp_vote():
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=4)
    sched.add_sequence(0, [3] * 5, _C.SamplingLimits(8))
    assert sched.can_prefill()
    assert sched.schedule(_C.StepType.DECODE).type == _C.StepType.IDLE, "nothing running to decode"
    sched.process(batch := sched.schedule(_C.StepType.PREFILL), [9] * batch.num_seqs)
    sched.add_sequence(1, [3] * 5, _C.SamplingLimits(8))
    forced = sched.schedule(_C.StepType.DECODE)
    assert forced.type == _C.StepType.DECODE and list(forced.seq_ids) == [0] and sched.num_waiting == 1
    sched.process(forced, [9])
    assert sched.schedule().type == _C.StepType.PREFILL


# ---- async scheduling: schedule(N+1) while step N runs ------------------------------------------------------

def _token(seq_id, index):
    """The token a deterministic 'model' draws as output token `index` of a sequence: the same whatever the
    batch, the step or a preemption, so sync and async runs must produce the same outputs."""
    return EOS if (seq_id * 7 + index * 3) % 11 == 0 else 9


def _drawn(batch):
    return [_token(s, ctx) for s, drawn, ctx in zip(batch.seq_ids, batch.sampled, batch.context_lens) if drawn]


def _record(outs, outputs, reasons):
    for out in outs:
        if out.seq_id in reasons:  # ended from outside while its step ran: the row must be void
            assert out.finished and not out.tokens
            continue
        outputs.setdefault(out.seq_id, []).extend(out.tokens)
        if out.finished:
            assert out.seq_id not in reasons, "a sequence finished twice"
            reasons[out.seq_id] = out.reason


def _run_sync(sched):
    outputs, reasons = {}, {}
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.type != _C.StepType.IDLE, "unfinished sequences but no step"
        _record(sched.process(batch, _drawn(batch)), outputs, reasons)
        sched.check_invariants()
    return outputs, reasons


def _run_async(sched, abort_every=0):
    """The engine's async loop: schedule_ahead while the decode step in flight 'runs', process it, complete the
    ahead step and put it in flight. abort_every > 0 aborts a running sequence every that many steps, while a
    step that writes its KV is in flight (its blocks must wait for that step). Returns (outputs, reasons, the
    number of ahead steps run, aborted ids)."""
    outputs, reasons, aborted, flight, ahead_steps, step = {}, {}, set(), None, 0, 0
    while sched.has_unfinished() or flight is not None:
        step += 1
        assert step < 5000
        if flight is None:
            flight = sched.schedule()
            assert flight.type != _C.StepType.IDLE, "unfinished sequences but no step: a deferred free starved it"
            if flight.type == _C.StepType.PREFILL:
                _record(sched.process(flight, _drawn(flight)), outputs, reasons)
                flight = None
                continue
        ahead = sched.schedule_ahead(flight)
        assert all(t == -1 for t in ahead.input_ids), "an ahead step's tokens are unknown until complete_ahead"
        _record(sched.process(flight, _drawn(flight)), outputs, reasons)
        flight = None
        if ahead.type == _C.StepType.DECODE:
            sched.complete_ahead(ahead)
        if ahead.type == _C.StepType.DECODE:
            for s, token in zip(ahead.seq_ids, ahead.input_ids):
                assert token == outputs[s][-1], "an ahead row is fed the token its sequence just drew"
            flight, ahead_steps = ahead, ahead_steps + 1
        if abort_every and step % abort_every == 0 and sched.running_ids():
            victim = sched.running_ids()[step % len(sched.running_ids())]
            sched.finish(victim, _C.FinishReason.ABORT)
            aborted.add(victim)
            reasons[victim] = _C.FinishReason.ABORT
        sched.check_invariants()
    return outputs, reasons, ahead_steps, aborted


trace = dict(prompts=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 16)), min_size=1, max_size=8),
             num_blocks=st.integers(12, 40), block_size=st.sampled_from([2, 4]), max_num_seqs=st.integers(1, 5))


def _add_all(sched, prompts):
    for sid, (n, max_tokens) in enumerate(prompts):
        sched.add_sequence(sid, [7] * n, _C.SamplingLimits(max_tokens))


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(**trace)
def test_async_scheduling_draws_the_tokens_sync_scheduling_draws(prompts, num_blocks, block_size, max_num_seqs):
    """Tiny pools included (preemption, ahead steps that give up for lack of blocks)."""
    runs = []
    for run in (_run_sync, _run_async):
        sched = make_scheduler(num_blocks, block_size, max_num_seqs, max_model_len=24)
        _add_all(sched, prompts)
        runs.append(run(sched)[:2])
        assert sched.block_manager.num_free_blocks == num_blocks and sched.num_free_state_slots == max_num_seqs
    assert runs[0] == runs[1]


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(**trace, abort_every=st.integers(1, 4))
def test_async_aborts_in_flight_defer_frees_without_starving(prompts, num_blocks, block_size, max_num_seqs,
                                                             abort_every):
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, max_model_len=24)
    _add_all(sched, prompts)
    outputs, reasons, _, aborted = _run_async(sched, abort_every)
    assert sorted(reasons) == list(range(len(prompts)))
    assert {s for s, r in reasons.items() if r == _C.FinishReason.ABORT} == aborted
    assert sched.block_manager.num_free_blocks == num_blocks and sched.num_free_state_slots == max_num_seqs
    sched.check_invariants()


def _decode_in_flight(num_blocks, max_tokens):
    """A scheduler (blocks of 4) whose sequences (5-token prompts, max_tokens each) are prefilled, and the decode
    step it then schedules, not yet processed."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4)
    for sid, n in enumerate(max_tokens):
        sched.add_sequence(sid, [3] * 5, _C.SamplingLimits(n))
    sched.process(sched.schedule(), [9] * len(max_tokens))
    return sched, sched.schedule()


def test_ahead_step_feeds_drawn_tokens_and_drops_sequences_that_ended():
    sched, flight = _decode_in_flight(40, [10, 10, 2])
    ahead = sched.schedule_ahead(flight)
    assert sorted(ahead.seq_ids) == [0, 1], "sequence 2 ends by length with the token in flight"
    assert ahead.positions.tolist() == [6, 6] and ahead.context_lens.tolist() == [7, 7]
    order = {s: i for i, s in enumerate(flight.seq_ids)}
    tokens = [0] * 3
    tokens[order[0]], tokens[order[1]], tokens[order[2]] = 9, EOS, 9
    outs = {o.seq_id: o for o in sched.process(flight, tokens)}
    assert outs[1].finished and outs[2].finished
    free_before = sched.block_manager.num_free_blocks
    sched.complete_ahead(ahead)
    assert ahead.seq_ids == [0] and ahead.input_ids.tolist() == [9] and ahead.query_start_loc.tolist() == [0, 1]
    assert sched.block_manager.num_free_blocks == free_before + 2, "the ended sequence's blocks return now"
    sched.check_invariants()


def test_finish_in_flight_frees_blocks_when_its_step_is_processed():
    sched, flight = _decode_in_flight(12, [10])
    held = len(sched.sequence(0).block_table)
    sched.finish(0, _C.FinishReason.ABORT)
    assert sched.block_manager.num_free_blocks == 12 - held and not sched.has_unfinished()
    outs = sched.process(flight, [9])
    assert outs[0].finished and not outs[0].tokens, "the aborted sequence's row is void"
    assert sched.block_manager.num_free_blocks == 12
    sched.check_invariants()


def test_no_ahead_step_while_a_prompt_waits_for_prefill():
    sched, flight = _decode_in_flight(40, [10])
    sched.add_sequence(1, [3] * 5, _C.SamplingLimits(10))
    assert sched.schedule_ahead(flight).type == _C.StepType.IDLE
    sched.process(flight, [9])
    assert sched.schedule().type == _C.StepType.PREFILL


def test_a_decode_that_evicts_its_only_sequence_lets_a_prefill_run_in_the_same_step():
    """24 blocks of 2: a 25-token prompt decodes while a 24-token one is prefilled a token per step; when the
    decoder needs its 14th block it can only evict itself, and the step must then go to the prefill."""
    sched = make_scheduler(num_blocks=24, block_size=2, max_num_seqs=2, budget=1)
    sched.add_sequence(0, [7] * 25, _C.SamplingLimits(3))
    sched.add_sequence(1, [7] * 24, _C.SamplingLimits(1))
    evicted = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.type != _C.StepType.IDLE, "unfinished sequences but no step"
        evicted += [(s, batch.type) for s in batch.preempted]
        sched.process(batch, [9] * int(batch.sampled.sum()))
        sched.check_invariants()
    assert (0, _C.StepType.PREFILL) in evicted
