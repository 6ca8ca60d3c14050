"""Per-step batch description every model forward receives, built from the C++ ScheduledBatch."""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """B sequences, T flat tokens. Tokens of sequence i are rows query_start_loc[i]:query_start_loc[i+1].

    is_prefill:      the step type (one per step)
    positions:       [T] int64 absolute position of each token
    slot_mapping:    [T] int64 paged-pool slot (block * block_size + offset) each token's KV goes to
    query_start_loc: [B + 1] int64 cumulative query lengths
    context_lens:    [B] int64 tokens in the cache after this step (including this step's queries)
    block_tables:    [B, max_blocks] int64 block ids, padded with -1
    state_slots:     [B] int64 StateBlock index of each sequence
    block_size:      source tokens per block
    """

    is_prefill: bool
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    block_size: int
    max_query_len: int
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def last_token_indices(self) -> torch.Tensor:
        """[B] row of each sequence's last query token (where logits are taken)."""
        return self.query_start_loc[1:] - 1
