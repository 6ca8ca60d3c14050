"""What a model asks the cache engine to allocate: paged tensors (per KV block) and state tensors
(per running sequence). The cache engine turns a spec into two pools and binds them to the model."""
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CacheTensor:
    """One tensor of a pool. shape is per block (paged pool) or per StateBlock (state pool)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass
class CacheSpec:
    """paged: name -> per-block tensor; a block holds `block_size` source tokens.
    state: name -> per-sequence tensor (sliding-window ring, compression accumulators)."""

    paged: dict[str, CacheTensor] = field(default_factory=dict)
    state: dict[str, CacheTensor] = field(default_factory=dict)

    @property
    def bytes_per_block(self) -> int:
        return sum(t.nbytes for t in self.paged.values())

    @property
    def bytes_per_state_block(self) -> int:
        return sum(t.nbytes for t in self.state.values())
