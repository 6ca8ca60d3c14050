"""Allocates the two pools a model's CacheSpec declares, inside kv_cache_memory bytes:
the state pool (one StateBlock per sequence slot) first, the paged pool from what is left."""
import logging

import torch

from deepinfer.formats.cache_spec import CacheSpec
from deepinfer.memory import huge_page_zeros, prefault

logger = logging.getLogger("deepinfer")


class CacheEngine:
    def __init__(self, spec: CacheSpec, kv_cache_memory: int, num_state_slots: int, block_size: int):
        self.spec, self.block_size, self.num_state_slots = spec, block_size, num_state_slots
        state_bytes = spec.bytes_per_state_block * num_state_slots
        if spec.bytes_per_block <= 0:
            raise ValueError("the model's cache spec declares no paged tensors")
        self.num_blocks = (kv_cache_memory - state_bytes) // spec.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes cannot hold {num_state_slots} state "
                             f"blocks ({state_bytes} bytes) and one KV block ({spec.bytes_per_block} bytes)")
        # Zeroed, not empty: masked-out slots are still read by attention, and stale NaN bytes
        # would poison softmax(.) @ V even with zero weight.
        # On huge pages (deepinfer/memory.py): decode attention streams the cache as it streams the weights.
        self.paged = {n: huge_page_zeros((self.num_blocks, *t.shape), t.dtype) for n, t in spec.paged.items()}
        self.state = {n: huge_page_zeros((num_state_slots, *t.shape), t.dtype) for n, t in spec.state.items()}
        # Backed at start, as engines that zero their caches with a write are: the first write of each page
        # would otherwise fault inside a step.
        for t in [*self.paged.values(), *self.state.values()]:
            prefault(t)

    @property
    def allocated_bytes(self) -> int:
        tensors = list(self.paged.values()) + list(self.state.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def memory_plan(self, max_model_len: int) -> dict:
        blocks_per_seq = -(-max_model_len // self.block_size)
        return {
            "bytes_per_token": self.spec.bytes_per_block / self.block_size,
            "bytes_per_block": self.spec.bytes_per_block,
            "bytes_per_state_block": self.spec.bytes_per_state_block,
            "num_blocks": self.num_blocks,
            "num_state_slots": self.num_state_slots,
            "tokens": self.num_blocks * self.block_size,
            "max_model_len_seqs": min(self.num_state_slots, self.num_blocks // blocks_per_seq),
            "allocated_bytes": self.allocated_bytes,
        }

    def log_memory_plan(self, max_model_len: int) -> None:
        p = self.memory_plan(max_model_len)
        logger.info("memory plan: %.1f bytes/token (%d bytes/block of %d tokens), %d bytes/StateBlock; "
                    "%d blocks = %d tokens, %d state slots, %d sequences of max_model_len=%d fit; %d bytes allocated",
                    p["bytes_per_token"], p["bytes_per_block"], self.block_size, p["bytes_per_state_block"],
                    p["num_blocks"], p["tokens"], p["num_state_slots"], p["max_model_len_seqs"], max_model_len,
                    p["allocated_bytes"])

    def export(self, block_ids: list[int], state_slot: int | None) -> dict[str, torch.Tensor]:
        """Copies of one sequence's blocks ("paged.<name>" [n, ...]) and, unless state_slot is None, its
        StateBlock ("state.<name>")."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        out = {f"paged.{n}": t[idx].clone() for n, t in self.paged.items()}
        if state_slot is not None:
            out.update({f"state.{n}": t[state_slot].clone() for n, t in self.state.items()})
        return out

    def load(self, block_ids: list[int], state_slot: int | None, data: dict[str, torch.Tensor]) -> None:
        """Writes an export() into this pool's blocks (and slot, unless None); the pools must share a spec."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        for n, t in self.paged.items():
            t[idx] = data[f"paged.{n}"]
        if state_slot is not None:
            for n, t in self.state.items():
                t[state_slot] = data[f"state.{n}"]
