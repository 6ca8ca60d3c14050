"""Content-addressed prefix KV store: KV-cache blocks of finished prompts, keyed by a hash chain over
their token ids and kept on disk, so a later request (in this or another process) with the same token
prefix loads them instead of recomputing them.

Backend: LMDB through py-lmdb 3.0.0 (bundles LMDB 0.9.36). Of the RocksDB bindings, rocksdict 0.3.29
and rocksdb-py 0.0.6 install as cp311 wheels, python-rocksdb 0.7.0 has no wheel (source build only).
LMDB wins: mature, one mmap'd file, several processes may open the same path (its lock file; RocksDB
takes one process), ACID transactions over several named dbs keep data, recency and size consistent,
reads copy straight from the page cache, and no background compaction can stall a load.

Layout (named dbs of one environment):
  blocks:  hash -> blake2b-16(payload) || payload, payload = safetensors bytes of {name: tensor}
  recency: hash -> (access counter, value size) as big-endian u64s
  lru:     access counter (big-endian u64, so key order is age order) -> hash; first key = LRU
  meta:    b"bytes" -> total value bytes, b"clock" -> last access counter
LMDB forbids opening an environment twice in one process, so the stores of one path in a process (two
engines sharing a store) share one environment, counted; do not carry an open store across fork().
"""
import hashlib
import logging
import os
import struct

import lmdb
import torch
from safetensors.torch import load as st_load, save as st_save

logger = logging.getLogger("deepinfer")

_U64 = struct.Struct(">Q")
_REC = struct.Struct(">QQ")
_SUM = 16                   # checksum bytes in front of each value
_MAP_OVERHEAD = 64 << 20    # B+tree pages, copy-on-write and fragmentation beyond the live values


_ENVS: dict[str, list] = {}  # realpath -> [environment, open stores]


def _open_env(path: str, map_size: int):
    key = os.path.realpath(path)
    if key not in _ENVS:
        _ENVS[key] = [lmdb.open(path, map_size=map_size, max_dbs=4), 0]
    entry = _ENVS[key]
    entry[1] += 1
    if entry[0].info()["map_size"] < map_size:
        entry[0].set_mapsize(map_size)
    return entry[0]


def _close_env(env) -> None:
    for key, entry in list(_ENVS.items()):
        if entry[0] is env:
            entry[1] -= 1
            if entry[1] == 0:
                del _ENVS[key]
                env.close()


def block_hashes(token_ids: list[int], block_size: int, namespace: bytes) -> list[bytes]:
    """16-byte chain hash per FULL block: h_0 = blake2b(seed || tokens[0:bs]), h_i = blake2b(h_{i-1} ||
    tokens of block i), seed = blake2b-16(namespace), tokens as int32 little-endian. A block's hash thus
    names its whole prefix. len = len(token_ids) // block_size; a partial last block is not hashed."""
    # A fixed-length seed, not the raw namespace: namespace || tokens could otherwise read the same
    # for two (namespace, block_size) pairs.
    prev = hashlib.blake2b(namespace, digest_size=16).digest()
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = struct.pack(f"<{block_size}i", *token_ids[start:start + block_size])
        prev = hashlib.blake2b(prev + tokens, digest_size=16).digest()
        out.append(prev)
    return out


class PrefixStore:
    """KV blocks by chain hash, LRU-bounded to max_bytes of stored values, persistent at `path` (a
    directory). namespace fingerprints what makes blocks interchangeable (model, dtypes, block size);
    it seeds the hash chain, so another namespace's entries never match."""

    def __init__(self, path: str, max_bytes: int, namespace: str | bytes):
        self.max_bytes = int(max_bytes)
        self.namespace = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
        self._env = _open_env(path, max(2 * self.max_bytes, 64 << 20) + _MAP_OVERHEAD)
        self._blocks, self._rec, self._lru, self._meta = (
            self._env.open_db(n) for n in (b"blocks", b"recency", b"lru", b"meta"))
        self._counts = dict(hits=0, misses=0, state_hits=0, state_misses=0, stored=0, evicted=0, corrupt=0)
        with self._txn(write=True) as txn:
            self._evict(txn, self.max_bytes)    # a reopen with a smaller budget shrinks the store now

    def hashes(self, token_ids: list[int], block_size: int) -> list[bytes]:
        return block_hashes(token_ids, block_size, self.namespace)

    def match(self, hashes: list[bytes]) -> int:
        """Number of leading hashes present. Looks at recency (small values), not blocks, so no payload
        is copied; the two dbs change together in one transaction."""
        with self._txn() as txn:
            for n, h in enumerate(hashes):
                if txn.get(h, db=self._rec) is None:
                    return n
        return len(hashes)

    def load(self, hashes: list[bytes], counter: str = "") -> list[dict[str, torch.Tensor]]:
        """Blocks of the longest leading run that exist and pass their checksum (CPU tensors). A corrupt
        entry is deleted and ends the run. Returned blocks become the most recently used. counter: which
        hit / miss counts this load adds to ("" for KV blocks, "state_" for StateBlock snapshots)."""
        with self._txn() as txn:
            raws = []
            for h in hashes:
                raw = txn.get(h, db=self._blocks)
                if raw is None:
                    break
                raws.append(raw)
        out, bad = [], None
        for h, raw in zip(hashes, raws):     # decode outside any transaction: no lock held meanwhile
            block = _decode(raw)
            if block is None:
                bad = (h, raw)
                break
            out.append(block)
        if out or bad:
            with self._txn(write=True) as txn:
                # Another process may have replaced the entry since it was read.
                if bad and txn.get(bad[0], db=self._blocks) == bad[1]:
                    self._delete(txn, bad[0])
                    self._counts["corrupt"] += 1
                    logger.warning("prefix store: dropped corrupt block %s (%d bytes)", bad[0].hex(), len(bad[1]))
                self._touch(txn, hashes[:len(out)])
        self._counts[counter + "hits"] += len(out)
        self._counts[counter + "misses"] += len(hashes) - len(out)
        return out

    def save(self, hashes: list[bytes], blocks: list[dict[str, torch.Tensor]]) -> int:
        """Stores the blocks whose hash is absent; returns how many were written. Then evicts LRU entries
        until stored value bytes <= max_bytes. A block larger than max_bytes alone is not stored."""
        with self._txn() as txn:
            todo = [(h, b) for h, b in zip(hashes, blocks, strict=True) if txn.get(h, db=self._rec) is None]
        values = [(h, v) for h, v in ((h, _encode(b)) for h, b in todo) if len(v) <= self.max_bytes]
        if not values:
            return 0
        for _ in range(3):
            try:
                with self._txn(write=True) as txn:
                    n = self._insert(txn, values)
                self._counts["stored"] += n
                return n
            except lmdb.MapFullError:
                # Live bytes fit the budget but the map has no free run long enough (fragmentation, a
                # reader pinning old pages): free more space and retry.
                with self._txn(write=True) as txn:
                    self._evict(txn, self._get(txn, b"bytes") // 2)
        logger.warning("prefix store: map full, %d blocks not stored", len(values))
        return 0

    def stats(self) -> dict:
        """This object's hits/misses (blocks, state snapshots)/stored/evicted/corrupt counts; bytes and entries
        of the store."""
        with self._txn() as txn:
            return {**self._counts, "bytes": self._get(txn, b"bytes"),
                    "entries": txn.stat(self._blocks)["entries"]}

    def close(self):
        if self._env is not None:
            _close_env(self._env)
            self._env = None

    def __del__(self):
        if getattr(self, "_env", None) is not None and _ENVS is not None:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _txn(self, write: bool = False):
        try:
            return self._env.begin(write=write)
        except lmdb.MapResizedError:      # another process grew the map: adopt its size
            self._env.set_mapsize(0)
            return self._env.begin(write=write)

    def _get(self, txn, key: bytes) -> int:
        raw = txn.get(key, db=self._meta)
        return _U64.unpack(raw)[0] if raw else 0

    def _stamp(self, txn, h: bytes, size: int, clock: int):
        txn.put(h, _REC.pack(clock, size), db=self._rec)
        txn.put(_U64.pack(clock), h, db=self._lru)

    def _touch(self, txn, hashes: list[bytes]):
        clock = self._get(txn, b"clock")
        # Reversed: a chain's first block ends newest, so eviction cuts chains from the tail and the
        # remaining head still matches.
        for h in reversed(hashes):
            rec = txn.get(h, db=self._rec)
            if rec is not None:
                old, size = _REC.unpack(rec)
                txn.delete(_U64.pack(old), db=self._lru)
                clock += 1
                self._stamp(txn, h, size, clock)
        txn.put(b"clock", _U64.pack(clock), db=self._meta)

    def _insert(self, txn, values: list[tuple[bytes, bytes]]) -> int:
        clock, total, n = self._get(txn, b"clock"), self._get(txn, b"bytes"), 0
        for h, v in reversed(values):           # reversed: see _touch
            if txn.get(h, db=self._rec) is not None:
                continue                        # another process stored it since save() looked
            clock, total, n = clock + 1, total + len(v), n + 1
            txn.put(h, v, db=self._blocks)
            self._stamp(txn, h, len(v), clock)
        txn.put(b"clock", _U64.pack(clock), db=self._meta)
        txn.put(b"bytes", _U64.pack(total), db=self._meta)
        self._evict(txn, self.max_bytes)
        return n

    def _evict(self, txn, limit: int):
        while self._get(txn, b"bytes") > limit:
            with txn.cursor(db=self._lru) as cur:
                if not cur.first():
                    break
                key, h = cur.item()
            txn.delete(key, db=self._lru)   # by key too: a stale lru row must not loop forever
            self._delete(txn, h)
            self._counts["evicted"] += 1

    def _delete(self, txn, h: bytes):
        rec = txn.get(h, db=self._rec)
        txn.delete(h, db=self._blocks)
        if rec is not None:
            clock, size = _REC.unpack(rec)
            txn.delete(h, db=self._rec)
            txn.delete(_U64.pack(clock), db=self._lru)
            txn.put(b"bytes", _U64.pack(max(self._get(txn, b"bytes") - size, 0)), db=self._meta)


def _encode(block: dict[str, torch.Tensor]) -> bytes:
    payload = st_save({k: t.detach().cpu().contiguous() for k, t in block.items()})
    return hashlib.blake2b(payload, digest_size=_SUM).digest() + payload


def _decode(raw: bytes) -> dict[str, torch.Tensor] | None:
    """The block, or None when the value is truncated, fails its checksum or does not parse."""
    payload = raw[_SUM:]
    if len(raw) < _SUM or hashlib.blake2b(payload, digest_size=_SUM).digest() != raw[:_SUM]:
        return None
    try:
        return st_load(payload)
    except Exception:       # a checksum over bytes that were already bad when written
        return None
