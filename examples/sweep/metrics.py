"""The sweep's arithmetic, kept free of timing so it can be unit-tested on synthetic numbers.

Axes follow DeepInfer's plot_pareto.py, with one change: the tokens a step commits per sequence are
a measurement (`accepted_tokens_per_step`), never an assumed tau, unless the caller asks for an
assumed curve explicitly (and then labels it as such)."""
import math


def steps_per_second(step_seconds: list[float]) -> float:
    """Steps over the total time of the measured steps (not the mean of per-step rates)."""
    if not step_seconds or sum(step_seconds) <= 0:
        raise ValueError("need at least one measured step with positive time")
    return len(step_seconds) / sum(step_seconds)


def per_user_tps(sps: float, tokens_per_step: float = 1.0) -> float:
    """Tokens per second one sequence sees: steps/s x tokens each step commits to it."""
    return sps * tokens_per_step


def per_rank_tps(sps: float, num_requests: int, ranks: int = 1, tokens_per_step: float = 1.0) -> float:
    """Tokens per second per rank: every request advances tokens_per_step per step, shared by ranks."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return sps * num_requests * tokens_per_step / ranks


def accepted_tokens_per_step(tokens_before: int, tokens_after: int, steps: int, num_requests: int) -> float:
    """Measured tokens committed per sequence per decode step (1.0 exactly without drafting)."""
    if steps < 1 or num_requests < 1:
        raise ValueError("need steps >= 1 and num_requests >= 1")
    return (tokens_after - tokens_before) / (steps * num_requests)


def tau_from_acceptance(nextn: int, acceptance: float) -> float:
    """DeepInfer's assumed acceptance length: tau = 1 + nextn x a (an input, not a measurement)."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance rate must be in [0, 1], got {acceptance}")
    return 1 + nextn * acceptance


def chain_tau(nextn: int, acceptance: float) -> float:
    """Expected tokens per step when draft i only counts if drafts 1..i-1 were accepted:
    1 + a + a^2 + ... + a^nextn (for comparison with the linear formula above)."""
    return sum(acceptance ** i for i in range(nextn + 1))


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts per layer when `tokens` tokens each pick top_k of num_experts
    uniformly: E x (1 - (1 - k/E)^B)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def floor_ms(bytes_moved: float, flops: float, bandwidth: float, matmul_rate: float) -> dict:
    """The physical floor of one step: bytes over bandwidth or FLOPs over matmul rate, whichever
    is larger (they can overlap, so the max, not the sum)."""
    by_bytes, by_flops = 1000 * bytes_moved / bandwidth, 1000 * flops / matmul_rate
    return {"ms_bytes": by_bytes, "ms_flops": by_flops, "ms": max(by_bytes, by_flops),
            "bound": "memory" if by_bytes >= by_flops else "compute"}


def time_over_floor(step_ms: float, floor: float) -> float:
    """How many floors a measured step takes (1.0 = at the floor)."""
    if floor <= 0 or math.isnan(floor):
        raise ValueError(f"floor must be positive, got {floor}")
    return step_ms / floor
