"""Balancers for disaggregated prefill / decode (engine/balancers.py): context tiers, keeping short and
long prompts apart, least queued work, dead engines, and the decode balancer's bound on load spread."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.balancers import DecodeBalancer, PrefillBalancer, RoundRobin

M = 1 << 20  # DeepInfer's 1M-token context: tiers at 16K, 64K, 256K


def test_tier_boundaries_are_deepinfers_for_a_1m_context_and_scale_with_the_model():
    b = PrefillBalancer(4, M)
    assert b.bounds == [16 << 10, 64 << 10, 256 << 10]
    for n, tier in [(1, 0), ((16 << 10) - 1, 0), (16 << 10, 1), ((64 << 10) - 1, 1), (64 << 10, 2),
                    ((256 << 10) - 1, 2), (256 << 10, 3), (M, 3)]:
        assert b.tier(n) == tier, n
    assert PrefillBalancer(2, 2048).bounds == [32, 128, 512]
    assert [PrefillBalancer(2, 2048).tier(n) for n in (31, 32, 127, 128, 511, 512)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("n, tiers", [(1, [[0], [0], [0], [0]]), (2, [[0], [0], [1], [1]]),
                                      (3, [[0], [0], [1], [2]]), (4, [[0], [1], [2], [3]]),
                                      (8, [[0, 1], [2, 3], [4, 5], [6, 7]])])
def test_engines_are_split_among_tiers(n, tiers):
    b = PrefillBalancer(n, M)
    assert [b.engines_of(t) for t in range(4)] == tiers


def test_with_two_engines_long_and_short_prompts_are_separated():
    b = PrefillBalancer(2, 2048)
    assert b.pick(1024) == 1 and b.pick(1500) == 1  # long prompts on the long-tier engine
    assert [b.pick(n) for n in (16, 40, 64, 100)] == [0, 0, 0, 0]  # shorts never queue behind them
    b.done(1, 1024), b.done(1, 1500)
    assert b.pick(16) == 1  # idle now: a short may take it...
    assert b.pick(16) == 0  # ...but not once something is queued there
    assert b.pick(2000) == 1  # and long prompts never go to engine 0


def test_queue_depth_in_tokens_then_requests_then_index():
    b, tier0 = PrefillBalancer(8, M), {0, 1}  # tier 0 has engines 0 and 1 (the others would take it idle)
    assert b.pick(100, tier0) == 0 and b.pick(300, tier0) == 1
    assert b.pick(100, tier0) == 0  # 100 queued tokens < 300
    assert b.tokens[:2] == [200, 300] and b.count[:2] == [2, 1]
    assert b.pick(100, tier0) == 0  # 200 < 300
    b.done(1, 300)
    assert b.pick(50, tier0) == 1
    c = PrefillBalancer(8, M)
    c.pick(100, tier0), c.pick(50, tier0), c.pick(50, tier0)  # engine 0: 100 in 1, engine 1: 100 in 2
    assert (c.tokens[:2], c.count[:2]) == ([100, 100], [1, 2])
    assert c.pick(10, tier0) == 0  # equal tokens: fewer queued requests
    assert c.pick(10) == 2  # an idle engine of a longer tier beats both


def test_dead_engines_are_excluded_and_a_dead_tier_falls_back_to_any_alive_engine():
    b = PrefillBalancer(2, 2048)
    assert b.pick(1024, alive={0}) == 0  # the long tier's engine is dead
    assert b.pick(16, alive={1}) == 1
    p = PrefillBalancer(8, M)
    assert p.pick(10, alive={1, 5}) == 1  # tier 0 still has engine 1
    assert p.pick(10, alive={5, 7}) == 5  # none of tier 0: least loaded alive
    d = DecodeBalancer(3)
    d.add(2, 10)
    assert d.pick(100, alive={1, 2}) == 1  # engine 0 is emptier but dead
    r = RoundRobin(3)
    assert [r.pick(alive={0, 2}) for _ in range(4)] == [0, 2, 0, 2]


@pytest.mark.parametrize("balancer", [PrefillBalancer(2, 2048), DecodeBalancer(2), RoundRobin(2)])
def test_no_engine_alive_raises(balancer):
    with pytest.raises(ValueError, match="no engine alive"):
        balancer.pick(10, alive=set())
    with pytest.raises(ValueError, match="no engine alive"):
        balancer.pick(10, alive={5})


def test_round_robin_takes_engines_in_turn():
    r = RoundRobin(3)
    assert [r.pick(n) for n in (9, 1, 9, 1)] == [0, 1, 2, 0]


def test_decode_pick_evens_count_and_kv_and_breaks_ties_by_index():
    d = DecodeBalancer(2)
    assert d.pick(100) == 0 and d.pick(100) == 1 and d.pick(100) == 0
    d.release(0, 100), d.release(0, 100)
    assert (d.count, d.kv) == ([0, 1], [0, 100])
    assert d.pick(5) == 0
    d = DecodeBalancer(2)
    d.add(0, 1000)
    assert [d.pick(10) for _ in range(3)] == [1, 1, 1]  # one huge request outweighs a few small ones


# ----------------------------------------------------------------------------------------------------
# properties

engines_st = st.integers(1, 9)
lens_st = st.lists(st.integers(1, 4096), max_size=40)


def _load(d: DecodeBalancer, total_kv: int, total_n: int) -> list[float]:
    return [d.kv[e] / total_kv + d.count[e] / total_n for e in range(len(d.kv))]


@settings(max_examples=200, deadline=None)
@given(engines_st, st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4096)), max_size=12), lens_st)
def test_decode_assign_spread_is_bounded_and_max_load_within_one_request_of_round_robin(n, running, kv_lens):
    """assign() is greedy list scheduling on load = kv share + count share, with fixed totals. Adding a
    request (weight w = kv/K + 1/N) to the least loaded engine keeps max - min <= max(before, w), so the
    final spread is <= max(initial spread, largest w). From empty engines the greedy's max load is then
    <= mean + largest w <= round robin's max load + largest w (no placement has max below the mean)."""
    d = DecodeBalancer(n)
    for e, kv in running:
        d.add(e % n, kv)
    total_kv = max(1, sum(d.kv) + sum(kv_lens))
    total_n = max(1, sum(d.count) + len(kv_lens))
    before = _load(d, total_kv, total_n)
    w = max((k / total_kv + 1 / total_n for k in kv_lens), default=0.0)
    ranks = d.assign(kv_lens)
    after = _load(d, total_kv, total_n)
    assert max(after) - min(after) <= max(max(before) - min(before), w) + 1e-9
    if not running:
        rr = [0.0] * n
        for i, k in enumerate(kv_lens):
            rr[i % n] += k / total_kv + 1 / total_n
        assert max(after) <= max(rr) + w + 1e-9
    added = [d.count[e] - sum(1 for r, _ in running if r % n == e) for e in range(n)]
    assert [ranks.count(e) for e in range(n)] == added


@settings(max_examples=200, deadline=None)
@given(engines_st, st.lists(st.tuples(st.integers(1, 4096), st.booleans()), max_size=40), st.data())
def test_decode_pick_never_chooses_a_dominated_engine(n, steps, data):
    """Whatever ran before, the pick has no alive engine with both fewer-or-equal requests and KV and one
    of them strictly fewer; equal-length requests from empty engines stay within one of each other."""
    d = DecodeBalancer(n)
    placed = []
    for kv, finish_one in steps:
        if finish_one and placed:
            d.release(*placed.pop(data.draw(st.integers(0, len(placed) - 1))))
        alive = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
        before = list(zip(d.count, d.kv))
        e = d.pick(kv, alive)
        placed.append((e, kv))
        assert e in alive
        assert not any(before[o][0] <= before[e][0] and before[o][1] <= before[e][1] and before[o] != before[e]
                       for o in alive)
    same = DecodeBalancer(n)
    for _ in range(len(steps)):
        same.pick(77)
    assert max(same.count) - min(same.count) <= 1


@settings(max_examples=200, deadline=None)
@given(engines_st, st.integers(64, 1 << 20), st.lists(st.tuples(st.integers(1, 1 << 20), st.booleans()),
                                                      max_size=40), st.data())
def test_prefill_pick_keeps_tiers_apart(n, max_len, steps, data):
    """A prompt goes to an engine of its tier when one is alive, or an idle engine of a longer tier;
    so with n >= 2 engines, all alive, a prompt of tier <= 1 never queues behind one of tier >= 2.
    Queue depth counts exactly what was picked and not done."""
    b = PrefillBalancer(n, max_len)
    queued: list[list[int]] = [[] for _ in range(n)]
    all_alive_so_far = True
    for length, finish_one in steps:
        length = min(length, max_len)
        busy = [e for e in range(n) if queued[e]]
        if finish_one and busy:
            e = data.draw(st.sampled_from(busy))
            b.done(e, queued[e].pop(0))
        alive = data.draw(st.one_of(st.none(), st.sets(st.integers(0, n - 1), min_size=1)))
        live = set(range(n)) if alive is None else alive
        all_alive_so_far &= alive is None
        t = b.tier(length)
        own = [e for e in b.engines_of(t) if e in live]
        e = b.pick(length, alive)
        assert e in live
        if own:
            assert e in own or (b.engine_tier[e] > t and not queued[e])
        if all_alive_so_far and n >= 2 and t <= 1:
            assert all(b.tier(q) <= 1 for q in queued[e])
        if e not in own and b.engine_tier[e] < t:
            assert not own  # a shorter tier's engine only when none of the prompt's own is alive
        queued[e].append(length)
        assert b.tokens == [sum(q) for q in queued] and b.count == [len(q) for q in queued]
