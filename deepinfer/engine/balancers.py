"""Where a request runs when there are several engines: pure Python, no engine state.

- `DecodeBalancer`: decode engines (or DP ranks, engine/dp.py). Evens out both the number of running
  requests and their total KV length, since a decode step's time grows with both.
- `PrefillBalancer`: prefill engines. Buckets prompts into four context tiers and keeps long prompts on
  engines of their own, so a short prompt's first token never waits for a long prompt's prefill; within
  a tier, the engine with the least queued prefill work.
- `RoundRobin`: the baseline both are measured against (examples/bench_balancers.py).

Engines are numbered 0..n-1. `alive` (a set of engine numbers, None = all) excludes dead engines; a
pick with none alive raises ValueError. The front reports what finished (`done` / `release`) so the
loads count only what an engine still holds.
"""

NUM_TIERS = 4
# DeepInfer's tiers, for a 1M-token context: under 16K, 16K-64K, 64K-256K, 256K and up. As fractions of
# max_model_len (1/64, 1/16, 1/4) they scale to any model: 2K-token context -> 32, 128, 512 tokens.
TIER_FRACTIONS = (1 / 64, 1 / 16, 1 / 4)


def kv_at_end(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """KV tokens one sequence holds when it ends: its prompt plus max_tokens (no limit: up to max_model_len)."""
    return prompt_len + (max_tokens or max_model_len - prompt_len)


def _alive(num_engines: int, alive: set[int] | None) -> list[int]:
    """The engines to choose from, in index order; ValueError if none."""
    engines = list(range(num_engines)) if alive is None else sorted(e for e in alive if 0 <= e < num_engines)
    if not engines:
        raise ValueError(f"no engine alive among {num_engines}")
    return engines


class DecodeBalancer:
    """Places requests evening out both the request count and the total KV length (prompt + max_tokens,
    what a request holds at its end) of each engine, counting what each engine still runs."""

    def __init__(self, num_engines: int):
        self.count = [0] * num_engines  # running requests per engine
        self.kv = [0] * num_engines     # their KV lengths, summed

    def assign(self, kv_lens: list[int]) -> list[int]:
        """A batch: kv_lens [N] -> the engine of each. Longest first (LPT), each to the engine whose load
        after taking it is smallest, load = kv share + request-count share of the totals with the batch."""
        engines = [0] * len(kv_lens)
        total_kv, total_n = sum(self.kv) + sum(kv_lens), sum(self.count) + len(kv_lens)
        for i in sorted(range(len(kv_lens)), key=lambda i: -kv_lens[i]):
            engines[i] = self._best(kv_lens[i], total_kv, total_n, range(len(self.kv)))
            self.add(engines[i], kv_lens[i])
        return engines

    def pick(self, kv_len: int, alive: set[int] | None = None) -> int:
        """One request -> its engine among the alive ones (same load as assign, totals with this
        request; ties to the lowest index), recorded as running there."""
        engine = self._best(kv_len, sum(self.kv) + kv_len, sum(self.count) + 1, _alive(len(self.kv), alive))
        self.add(engine, kv_len)
        return engine

    def _best(self, kv_len: int, total_kv: int, total_n: int, engines) -> int:
        # Shares, not raw sums: KV lengths are in tokens and counts in requests, so each is divided by
        # its total to weigh the two alike. min() keeps the first of equal scores: the lowest index.
        total_kv, total_n = max(1, total_kv), max(1, total_n)
        return min(engines, key=lambda e: (self.kv[e] + kv_len) / total_kv + (self.count[e] + 1) / total_n)

    def add(self, engine: int, kv_len: int) -> None:
        self.count[engine] += 1
        self.kv[engine] += kv_len

    def release(self, engine: int, kv_len: int) -> None:
        """The request finished (or was moved): it no longer loads its engine."""
        self.count[engine] -= 1
        self.kv[engine] -= kv_len


class PrefillBalancer:
    """Four context tiers, engines split among them, least queued work within a tier.

    Tier boundaries are max_model_len/64, /16 and /4 (DeepInfer's 16K / 64K / 256K of a 1M context).
    With at least 4 engines, engine e serves tier e * 4 // n (n=4: one each; n=8: two each). With fewer,
    tiers share engines, tier t on engine t * n // 4: n=2 gives engine 0 tiers 0-1 and engine 1 tiers 2-3,
    so short and long prompts never share a queue once there are 2 engines. A prompt may also take an
    idle engine of a longer tier (it queues behind nothing there, and the engine would otherwise wait
    for long prompts with nothing to do); never one of a shorter tier, unless all of its own are dead.

    Queue depth = prompt tokens picked for an engine and not yet `done` (prefill time grows with them),
    ties to fewer queued requests, then the lowest index."""

    def __init__(self, num_engines: int, max_model_len: int):
        if num_engines < 1 or max_model_len < 1:
            raise ValueError(f"PrefillBalancer({num_engines}, {max_model_len}): both must be >= 1")
        self.num_engines = num_engines
        self.bounds = [max(1, int(max_model_len * f)) for f in TIER_FRACTIONS]
        if num_engines >= NUM_TIERS:
            self.engine_tier = [e * NUM_TIERS // num_engines for e in range(num_engines)]
        else:  # the first engine of each tier's share
            self.engine_tier = [min(t for t in range(NUM_TIERS) if t * num_engines // NUM_TIERS == e)
                                for e in range(num_engines)]
        self.tokens = [0] * num_engines  # queued prompt tokens per engine
        self.count = [0] * num_engines   # queued prompts per engine

    def tier(self, prompt_len: int) -> int:
        """0: under max_model_len/64, 1: under /16, 2: under /4, 3: the rest."""
        return sum(prompt_len >= b for b in self.bounds)

    def engines_of(self, tier: int) -> list[int]:
        """The engines reserved for a tier."""
        if self.num_engines >= NUM_TIERS:
            return [e for e in range(self.num_engines) if self.engine_tier[e] == tier]
        return [tier * self.num_engines // NUM_TIERS]

    def pick(self, prompt_len: int, alive: set[int] | None = None) -> int:
        """One prompt -> its engine, recorded as queued there until `done`."""
        live = _alive(self.num_engines, alive)
        t = self.tier(prompt_len)
        own = [e for e in self.engines_of(t) if e in live]
        idle_longer = [e for e in live if self.engine_tier[e] > t and self.count[e] == 0]
        candidates = own + idle_longer or live  # the tier's engines all dead: any alive engine
        engine = min(candidates, key=lambda e: (self.tokens[e], self.count[e], e))
        self.tokens[engine] += prompt_len
        self.count[engine] += 1
        return engine

    def done(self, engine: int, prompt_len: int) -> None:
        """The engine finished this prompt's prefill."""
        self.tokens[engine] -= prompt_len
        self.count[engine] -= 1


class RoundRobin:
    """The baseline for either role: engines in turn (skipping dead ones), blind to load."""

    def __init__(self, num_engines: int):
        self.num_engines, self.next = num_engines, 0

    def pick(self, length: int = 0, alive: set[int] | None = None) -> int:
        live = _alive(self.num_engines, alive)
        engine = next((e for e in live if e >= self.next), live[0])
        self.next = (engine + 1) % self.num_engines
        return engine

    def done(self, engine: int, length: int = 0) -> None:
        """Nothing to track; here so RoundRobin drops in for either balancer."""

    release = done
