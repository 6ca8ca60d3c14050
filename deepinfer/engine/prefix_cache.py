"""An engine's prefix cache over the prefix KV store (engine/prefix_store.py), DeepInfer's 3FS role.

A prompt's full blocks are stored once its prefill is done, content-addressed by the chained hash of the token
prefix they complete. A later sequence whose prompt starts with stored blocks loads them (all but the block holding
its last prompt token, whose logits it still needs) and prefills only the rest. A model with a StateBlock
(DeepSeek-V4) needs the state at the end of the loaded prefix: the first sequence to reach a prefix rebuilds it by
exact replay (engine/kv_transfer.py) and stores that snapshot beside the blocks (as DeepInfer keeps SWA state on
disk), so later sequences, here or in another process, load it. The namespace seeds the hash chain with what makes
blocks interchangeable (the weights, dtype, KV format, block size and cache layout), so two models sharing one store
never see each other's blocks."""
import hashlib
import os

import torch

from deepinfer.engine.prefix_store import PrefixStore

DEFAULT_MAX_BYTES = 4 << 30


class PrefixCache:
    def __init__(self, store: PrefixStore, block_size: int):
        self.store, self.block_size = store, block_size

    @classmethod
    def from_config(cls, config, spec) -> "PrefixCache":
        """config.prefix_cache: a store directory, or {"path": dir, "max_bytes": limit (default 4 GiB)}; spec: the
        engine's CacheSpec (its tensors enter the namespace: an MTP ring in the StateBlock makes another one)."""
        opts = config.prefix_cache if isinstance(config.prefix_cache, dict) else {"path": config.prefix_cache}
        unknown = set(opts) - {"path", "max_bytes"}
        if unknown or not isinstance(opts.get("path"), str):
            raise ValueError(f"LLM(prefix_cache=...) must be a directory or {{'path': dir, 'max_bytes': n}}, "
                             f"got {config.prefix_cache!r}")
        layout = sorted((n, tuple(t.shape), str(t.dtype)) for pool in (spec.paged, spec.state) for n, t in pool.items())
        namespace = "|".join([model_fingerprint(config.model), str(config.dtype), config.kv_cache_dtype,
                              str(config.block_size), repr(layout)])
        store = PrefixStore(opts["path"], int(opts.get("max_bytes", DEFAULT_MAX_BYTES)), namespace)
        return cls(store, config.block_size)

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        return self.store.hashes(list(token_ids), self.block_size)

    def lookup(self, prompt_token_ids: list[int]) -> tuple[list[dict[str, torch.Tensor]], bytes | None]:
        """Stored blocks the prompt may reuse: the leading run of its full blocks short of its last token
        (checksums verified; a corrupt entry ends the run and is recomputed), and the last one's hash."""
        usable = (len(prompt_token_ids) - 1) // self.block_size
        hashes = self.hashes(prompt_token_ids[:usable * self.block_size])
        blocks = self.store.load(hashes)
        return blocks, hashes[len(blocks) - 1] if blocks else None

    def write(self, engine, seq, blocks: list[dict[str, torch.Tensor]], last_hash: bytes) -> None:
        """Writes a hit's blocks into the sequence's first blocks, and its StateBlock at the prefix's end: a
        stored snapshot, or an exact replay whose result is stored for the next sequence."""
        engine.cache.load(list(seq.block_table[:len(blocks)]), None, self._stack(blocks))
        if engine.cache.spec.bytes_per_state_block == 0:
            return
        key = hashlib.blake2b(last_hash + b"state", digest_size=16).digest()
        snapshot = self.store.load([key], counter="state_")
        if snapshot:
            engine.cache.load([], seq.state_slot, snapshot[0])
            return
        engine.state_transfer.rebuild(seq, len(blocks) * self.block_size)
        self.store.save([key], [engine.cache.export([], seq.state_slot)])

    def save_prompts(self, engine, batch) -> None:
        """Stores the prompt blocks of every sequence whose prefill ends in this (just computed) step."""
        tables = batch.block_tables  # [B, max_blocks]
        for i, (seq_id, sampled) in enumerate(zip(batch.seq_ids, batch.sampled)):
            if not sampled:
                continue
            seq = engine.scheduler.sequence(seq_id)
            hashes = self.hashes(seq.token_ids[:seq.num_prompt_tokens])
            have = self.store.match(hashes)
            if have < len(hashes):
                self.store.save(hashes[have:], self._blocks(engine.cache, tables[i, have:len(hashes)].tolist()))

    @staticmethod
    def _blocks(cache, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        data = cache.export(block_ids, None)  # a copy: the blocks are views of it, no second copy
        return [{name: t[i] for name, t in data.items()} for i in range(len(block_ids))]

    @staticmethod
    def _stack(blocks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-block dicts -> one export() dict ([n, ...] per tensor)."""
        return {name: torch.stack([b[name] for b in blocks]) for name in blocks[0]}


def model_fingerprint(path: str) -> str:
    """The model directory (or file) and the size and mtime of every file in it: new weights, new blocks."""
    path = os.path.abspath(path)
    files = [path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path))
    digest = hashlib.blake2b(digest_size=16)
    for f in files:
        st = os.stat(f)
        digest.update(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"{path}#{digest.hexdigest()}"
