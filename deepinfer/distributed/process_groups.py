"""The DP group's torch.distributed state: one group whose ranks are the DP ranks.

MoE all-to-alls run on the device backend (NCCL when the experts live on a GPU, gloo on CPU); the
per-step vote is a tiny CPU all-reduce and always uses gloo. Everything binds to 127.0.0.1."""
import datetime
import os
import random
import socket

import torch
import torch.distributed as dist


# Ray's workers take ports up to 19999 by default, and the kernel hands out ephemeral ports from
# ip_local_port_range (32768 up, by default): a port between them stays free from the check until the master
# binds it seconds later, where an ephemeral one was seen taken by then (EADDRINUSE in a disaggregated DP test).
_PORTS_FROM = 20000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now and outside the ranges others draw from, so still free when the master
    binds it; an ephemeral one if none is."""
    rng, below = random.SystemRandom(), _ephemeral_low()  # not the global RNG: tests seed it alike in every process
    candidates = [rng.randrange(_PORTS_FROM, below) for _ in range(64)] + [0]
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(_PORTS_FROM + 1, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


class DPGroup:
    """rank, world_size; ep_group for MoE all-to-all, vote_group for the step vote."""

    def __init__(self, rank: int, world_size: int, port: int, device: str = "cpu", timeout_s: float = 120.0):
        # gloo picks its interface from the hostname unless told: keep every socket on loopback.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size, self.device = rank, world_size, device
        self.ep_group = dist.group.WORLD
        self.vote_group = dist.new_group(backend="gloo") if device.startswith("cuda") else dist.group.WORLD

    def vote(self, has_prefill: bool, has_decode: bool, *flags: bool) -> tuple[int, ...]:
        """All-reduces this rank's work -> (ranks with prefill work, ranks with decode work, then the count
        of ranks raising each extra flag: a disaggregated engine's ranks agree on stopping this way)."""
        t = torch.tensor([int(has_prefill), int(has_decode), *map(int, flags)], dtype=torch.int64)
        dist.all_reduce(t, group=self.vote_group)
        return tuple(int(x) for x in t)

    def agree(self, flags: list[bool]) -> list[bool]:
        """Each flag true only where every rank raised it (the same number of flags on every rank)."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        if flags:
            dist.all_reduce(t, group=self.vote_group)
        return [int(x) == self.world_size for x in t]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a CPU tensor (expert load for EPLB)."""
        dist.all_reduce(t, group=self.vote_group)
        return t

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
