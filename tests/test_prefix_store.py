"""PrefixStore: chain hashes, bit-exact roundtrips, LRU eviction, persistence across objects and
processes, and corrupt or truncated entries dropped instead of returned."""
import json
import subprocess
import sys

import lmdb
import pytest
import torch

from deepinfer.engine.prefix_store import PrefixStore, block_hashes

NS = b"model|bfloat16|auto|4"
DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.int8, torch.float8_e4m3fn]


def _block(seed: int, dtype=torch.bfloat16, n: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.int8):
        info = torch.iinfo(dtype)
        make = lambda: torch.randint(info.min, info.max + 1, (2, n), generator=g, dtype=dtype)
    else:
        make = lambda: torch.randn(2, n, generator=g).to(dtype)
    return {"k": make(), "v": make()}


def _same(a: dict, b: dict) -> bool:
    """Bit-exact: compares raw bytes, so NaN payloads and -0.0 count too."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def _raw_env(path):
    env = lmdb.open(str(path), max_dbs=4)
    return env, env.open_db(b"blocks")


def test_chain_hashes():
    toks = list(range(1, 11))
    hs = block_hashes(toks, 4, NS)
    assert len(hs) == 2 and all(len(h) == 16 for h in hs) and hs[0] != hs[1]
    assert block_hashes(toks[:8], 4, NS) == hs                      # partial last block not hashed
    assert block_hashes(toks + [99, 98], 4, NS)[:2] == hs            # same prefix, same leading hashes
    assert block_hashes(toks[:3], 4, NS) == []
    changed = block_hashes([1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12], 4, NS)
    base = block_hashes(list(range(1, 13)), 4, NS)
    assert changed[0] == base[0] and changed[1] != base[1] and changed[2] != base[2]
    other = block_hashes(toks, 4, b"model|float32|auto|4")
    assert not set(other) & set(hs)                                 # namespace changes every block
    assert block_hashes(toks, 4, NS) == hs                          # deterministic
    assert block_hashes([-1, 2**31 - 1, 0, 5], 4, NS) != block_hashes([0, 2**31 - 1, 0, 5], 4, NS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_bit_exact(tmp_path, dtype):
    hs = block_hashes(list(range(12)), 4, NS)
    blocks = [_block(i, dtype) for i in range(3)]
    with PrefixStore(str(tmp_path / "s"), 1 << 20, NS) as store:
        assert store.save(hs, blocks) == 3
        assert store.save(hs, blocks) == 0                          # already present
        got = store.load(hs)
        assert len(got) == 3 and all(_same(a, b) for a, b in zip(got, blocks))
        assert all(t.device.type == "cpu" for b in got for t in b.values())
        st = store.stats()
        assert st["hits"] == 3 and st["misses"] == 0 and st["stored"] == 3 and st["entries"] == 3
        assert st["bytes"] > sum(t.numel() * t.element_size() for b in blocks for t in b.values())


def test_views_of_one_pool_are_saved(tmp_path):
    pool = torch.randn(4, 2, 8).to(torch.bfloat16)                  # like slices of the paged KV pool
    blocks = [{"k": pool[i, 0], "v": pool[i, 1]} for i in range(4)]
    hs = block_hashes(list(range(16)), 4, NS)
    with PrefixStore(str(tmp_path / "s"), 1 << 20, NS) as store:
        assert store.save(hs, blocks) == 4
        assert all(_same(a, b) for a, b in zip(store.load(hs), blocks))


def test_match_counts_leading_run(tmp_path):
    hs = block_hashes(list(range(20)), 4, NS)
    with PrefixStore(str(tmp_path / "s"), 1 << 20, NS) as store:
        assert store.match(hs) == 0 and store.load(hs) == []
        store.save(hs[:2], [_block(0), _block(1)])
        store.save(hs[3:4], [_block(3)])                            # a gap at 2: block 3 is unreachable
        assert store.match(hs) == 2
        assert store.match(hs[:1]) == 1 and store.match([]) == 0
        assert len(store.load(hs)) == 2
        assert store.stats()["misses"] == 5 + 3
        other = block_hashes(list(range(20)), 4, b"other")
        assert store.match(other) == 0


def test_lru_eviction(tmp_path):
    hs = block_hashes(list(range(16)), 4, b"lru")
    blocks = [_block(i, torch.float32, n=256) for i in range(4)]
    with PrefixStore(str(tmp_path / "s"), 1 << 20, NS) as probe:
        probe.save(hs[:1], blocks[:1])
        size = probe.stats()["bytes"]
    with PrefixStore(str(tmp_path / "t"), 2 * size, NS) as store:  # room for exactly two blocks
        # Saved one by one: each is its own chain.
        assert store.save([hs[0]], [blocks[0]]) == 1
        assert store.save([hs[1]], [blocks[1]]) == 1
        assert len(store.load([hs[0]])) == 1                        # 0 is now newer than 1
        assert store.save([hs[2]], [blocks[2]]) == 1
        assert [store.match([h]) for h in hs[:3]] == [1, 0, 1]      # the un-accessed 1 went
        st = store.stats()
        assert st["evicted"] == 1 and st["entries"] == 2 and st["bytes"] == 2 * size
        assert store.save([hs[3]], [blocks[3]]) == 1
        assert [store.match([h]) for h in hs] == [0, 0, 1, 1]       # 0 was touched before 2 was saved
        assert store.stats()["evicted"] == 2


def test_chain_evicted_from_tail(tmp_path):
    hs = block_hashes(list(range(16)), 4, NS)
    blocks = [_block(i, torch.float32, n=256) for i in range(4)]
    with PrefixStore(str(tmp_path / "p"), 1 << 20, NS) as probe:
        probe.save(hs[:1], blocks[:1])
        size = probe.stats()["bytes"]
    with PrefixStore(str(tmp_path / "t"), 2 * size, NS) as store:
        assert store.save(hs, blocks) == 4                          # all written, then the tail evicted
        assert store.match(hs) == 2 and store.stats()["entries"] == 2
        assert all(_same(a, b) for a, b in zip(store.load(hs), blocks[:2]))
        # A load re-stamps the chain head as newest too: an unrelated save evicts the tail block 1.
        other = block_hashes([7] * 4, 4, b"other")
        assert store.save(other, [blocks[3]]) == 1
        assert store.match(hs) == 1 and store.match(other) == 1


def test_block_larger_than_budget_not_stored(tmp_path):
    hs = block_hashes(list(range(8)), 4, NS)
    with PrefixStore(str(tmp_path / "s"), 4096, NS) as store:
        assert store.save(hs[:1], [_block(0, torch.float32, n=4096)]) == 0
        assert store.save(hs[1:], [_block(1, torch.float32, n=8)]) == 1
        assert store.match(hs) == 0 and store.match(hs[1:]) == 1
        assert store.stats()["entries"] == 1


def test_reopen_same_object_and_subprocess(tmp_path):
    path = str(tmp_path / "s")
    hs = block_hashes(list(range(12)), 4, NS)
    blocks = [_block(i) for i in range(3)]
    with PrefixStore(path, 1 << 20, NS) as store:
        store.save(hs, blocks)
        before = store.stats()
    with PrefixStore(path, 1 << 20, NS) as store:
        st = store.stats()
        assert (st["bytes"], st["entries"]) == (before["bytes"], before["entries"]) and st["bytes"] > 0
        assert all(_same(a, b) for a, b in zip(store.load(hs), blocks))
        # Another process opens the same path while this one holds it open, reads, and adds a block.
        more = block_hashes(list(range(16)), 4, NS)
        code = (
            "import json, sys, torch\n"
            "from deepinfer.engine.prefix_store import PrefixStore\n"
            "hs = [bytes.fromhex(h) for h in json.loads(sys.argv[1])]\n"
            f"s = PrefixStore({path!r}, 1 << 20, {NS!r})\n"
            "got = s.load(hs[:3])\n"
            "s.save(hs[3:], [{'k': torch.arange(8, dtype=torch.int8)}])\n"
            "print(json.dumps({'n': len(got), 'sum': float(sum(b['k'].float().sum() for b in got)),"
            " 'stats': s.stats()}))\n"
            "s.close()\n")
        out = subprocess.run([sys.executable, "-c", code, json.dumps([h.hex() for h in more])],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        child = json.loads(out.stdout.strip().splitlines()[-1])
        assert child["n"] == 3 and child["sum"] == float(sum(b["k"].float().sum() for b in blocks))
        assert child["stats"]["entries"] == 4 and child["stats"]["bytes"] > before["bytes"]
        assert store.match(more) == 4                               # visible here without reopening
        assert store.stats()["bytes"] == child["stats"]["bytes"]
        assert torch.equal(store.load(more)[3]["k"], torch.arange(8, dtype=torch.int8))


def test_reopen_with_smaller_budget_evicts(tmp_path):
    path = str(tmp_path / "s")
    hs = block_hashes(list(range(16)), 4, NS)
    with PrefixStore(path, 1 << 20, NS) as store:
        store.save(hs, [_block(i, torch.float32, n=256) for i in range(4)])
        size = store.stats()["bytes"] // 4
    with PrefixStore(path, 2 * size, NS) as store:
        assert store.match(hs) == 2 and store.stats()["bytes"] <= 2 * size


def _damage(path, h, fn):
    env, db = _raw_env(path)
    with env.begin(write=True) as txn:
        txn.put(h, fn(txn.get(h, db=db)), db=db)
    env.close()


@pytest.mark.parametrize("damage", [
    lambda v: v[:-3] + bytes([v[-3] ^ 0x01]) + v[-2:],             # one flipped tensor-data bit
    lambda v: v[:5] + bytes([v[5] ^ 0xFF]) + v[6:],                 # a flipped checksum byte
    lambda v: v[: len(v) // 2],                                     # truncated
    lambda v: v[:7],                                                # shorter than the checksum
], ids=["flip-payload", "flip-checksum", "truncated", "stub"])
def test_corrupt_entry_dropped_and_repaired(tmp_path, damage, caplog):
    path = str(tmp_path / "s")
    hs = block_hashes(list(range(16)), 4, NS)
    blocks = [_block(i) for i in range(4)]
    with PrefixStore(path, 1 << 20, NS) as store:
        store.save(hs, blocks)
        full = store.stats()["bytes"]
    _damage(path, hs[2], damage)
    with PrefixStore(path, 1 << 20, NS) as store:
        assert store.match(hs) == 4                                 # match does not verify
        with caplog.at_level("WARNING", logger="deepinfer"):
            got = store.load(hs)
        assert len(got) == 2 and all(_same(a, b) for a, b in zip(got, blocks))
        assert "corrupt" in caplog.text
        st = store.stats()
        assert st["corrupt"] == 1 and st["entries"] == 3 and st["bytes"] == full - full // 4
        assert store.match(hs) == 2                                 # the entry is gone
        assert store.save(hs, blocks) == 1                          # and a later save repairs it
        assert all(_same(a, b) for a, b in zip(store.load(hs), blocks))
        assert store.stats()["bytes"] == full and store.stats()["corrupt"] == 1


def test_undecodable_payload_with_valid_checksum(tmp_path):
    import hashlib
    path = str(tmp_path / "s")
    hs = block_hashes(list(range(8)), 4, NS)
    with PrefixStore(path, 1 << 20, NS) as store:
        store.save(hs, [_block(0), _block(1)])
    junk = b"not safetensors"
    _damage(path, hs[0], lambda v: hashlib.blake2b(junk, digest_size=16).digest() + junk)
    with PrefixStore(path, 1 << 20, NS) as store:
        assert store.load(hs) == [] and store.stats()["corrupt"] == 1 and store.match(hs) == 0


def test_map_full_evicts_and_retries(tmp_path, monkeypatch):
    hs = block_hashes(list(range(16)), 4, NS)
    with PrefixStore(str(tmp_path / "s"), 1 << 20, NS) as store:
        store.save(hs[:2], [_block(0), _block(1)])
        real, calls = store._insert, []

        def insert_full_once(txn, values):
            calls.append(len(values))
            if len(calls) == 1:
                raise lmdb.MapFullError("simulated")
            return real(txn, values)

        monkeypatch.setattr(store, "_insert", insert_full_once)
        assert store.save(hs[2:], [_block(2), _block(3)]) == 2
        assert calls == [2, 2] and store.stats()["evicted"] >= 1    # space freed before the retry
        assert store.match(hs[2:]) == 2
