"""eplb.placement, eplb.stats and the replanning job: runtime maps, weight moves, load counts, plan files."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from eplb.placement import (ExpertPlacement, identity_phy2log, load_plan, moe_lb, moe_lb_total, plan_transfers,
                            rearrange, save_plan)
from eplb.policy import rebalance_experts
from eplb.replan import main as replan_main
from eplb.stats import ExpertLoadRecorder, load_stats


def _plan(L=3, E=16, R=24, gpus=4, seed=0):
    w = torch.tensor(np.random.default_rng(seed).pareto(1.0, (L, E)) * 100)
    return rebalance_experts(w, R, 1, 1, gpus)


def test_placement_maps_are_inverse():
    phy2log, log2phy, logcnt = _plan()
    pl = ExpertPlacement(phy2log, num_gpus=4)
    assert torch.equal(pl.logcnt, logcnt)
    assert torch.equal(pl.log2phy, log2phy)  # same ascending-slot convention as the policy
    for l in range(3):
        for e in range(16):
            slots = pl.log2phy[l, e][pl.log2phy[l, e] >= 0]
            assert len(slots) == pl.logcnt[l, e]
            assert (pl.phy2log[l, slots] == e).all()
            assert (slots.diff() > 0).all()
    assert list(pl.local_slots(1)) == [6, 7, 8, 9, 10, 11]


@settings(derandomize=True, max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 200), st.integers(1, 4))
def test_map_to_physical_is_consistent_and_even(seed, T, k):
    phy2log, _, logcnt = _plan(seed=seed % 7)
    pl = ExpertPlacement(phy2log, num_gpus=4)
    g = torch.Generator().manual_seed(seed)
    topk = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(T)])
    layer = seed % 3
    phys = pl.map_to_physical(topk, layer)
    assert phys.shape == topk.shape
    assert torch.equal(pl.phy2log[layer][phys], topk)          # each token lands on a replica of its expert
    per_slot = torch.bincount(phys.flatten(), minlength=24)
    for e in range(16):
        shares = per_slot[pl.log2phy[layer, e][pl.log2phy[layer, e] >= 0]]
        assert shares.sum() == (topk == e).sum()
        assert shares.max() - shares.min() <= 1                 # exactly even split


def test_map_to_physical_follows_the_documented_rule():
    pl = ExpertPlacement(torch.tensor([[0, 1, 0, 2, 0, 3]]), num_gpus=2)   # expert 0 in slots 0, 2, 4
    topk = torch.tensor([[0, 1], [0, 2], [3, 0], [0, 0]])
    # occurrences of expert 0 in row-major order: 1st -> slot 0, 2nd -> 2, 3rd -> 4, 4th -> 0, 5th -> 2
    assert pl.map_to_physical(topk).tolist() == [[0, 1], [2, 3], [5, 4], [0, 2]]


def test_map_to_physical_without_redundancy_is_the_inverse_permutation():
    g = torch.Generator().manual_seed(5)
    phy2log = torch.stack([torch.randperm(8, generator=g), torch.arange(8)])  # layer 1: identity
    pl = ExpertPlacement(phy2log, num_gpus=2)
    assert pl.single == [True, True]
    topk = torch.randint(0, 8, (5, 3), generator=g)
    for layer in (0, 1):
        phys = pl.map_to_physical(topk, layer)
        assert phys.shape == topk.shape and torch.equal(pl.phy2log[layer][phys], topk)
    assert torch.equal(pl.map_to_physical(topk, 1), topk)
    assert ExpertPlacement(torch.tensor([[0, 1, 0, 2]]), num_gpus=2).single == [False]


def test_recorder_counts_equal_a_recount():
    g = torch.Generator().manual_seed(3)
    L, E, W = 3, 10, 4
    rec = ExpertLoadRecorder(L, E, W)
    history = []
    for step in range(7):                                     # wraps the ring
        counts = np.zeros((L, E), np.int64)
        for layer in range(L):
            for _ in range(2):                                # several forwards per step (e.g. chunks)
                ids = torch.randint(0, E, (int(torch.randint(1, 40, (1,), generator=g)), 2), generator=g)
                rec.record(layer, ids)
                counts[layer] += np.bincount(ids.flatten().numpy(), minlength=E)
        rec.end_step()
        history.append(counts)
    win = rec.window_load()
    assert win.shape == (W, L, E) and win.dtype == torch.int64
    assert np.array_equal(win.numpy(), np.stack(history[-W:]))           # oldest first
    assert np.array_equal(rec.total().numpy(), np.stack(history[-W:]).sum(0))
    assert rec.steps == 7


def test_recorder_dump_load_round_trip(tmp_path):
    rec = ExpertLoadRecorder(2, 5, 8)
    for s in range(3):
        rec.record(0, torch.tensor([[s, 1], [2, 4]]))
        rec.record(1, torch.tensor([[3, 3]]))
        rec.end_step()
    path = str(tmp_path / "stats.npz")
    rec.dump(path)
    load, meta = load_stats(path)
    assert meta == {"num_layers": 2, "num_experts": 5, "window": 8, "steps": 3}
    assert np.array_equal(load, rec.window_load().numpy())
    back = ExpertLoadRecorder.load(path)
    assert torch.equal(back.window_load(), rec.window_load()) and back.steps == 3
    back.record(0, torch.tensor([[4, 4]]))
    back.end_step()
    assert back.window_load().shape == (4, 2, 5) and back.total()[0, 4].item() == 3 + 2


def test_recorder_rejects_bad_sizes():
    with pytest.raises(ValueError, match="window"):
        ExpertLoadRecorder(2, 4, 0)
    with pytest.raises(ValueError, match="num_experts"):
        ExpertLoadRecorder(2, -1, 3)


@pytest.mark.parametrize("one_layer", [True, False])
def test_rearrange_moves_weights_to_match_the_new_plan(one_layer):
    L, E, R, G = 3, 16, 24, 4
    old = _plan(L, E, R, G, seed=1)[0]
    new = rebalance_experts(torch.tensor(np.random.default_rng(9).pareto(1.0, (L, E)) * 100), R, 1, 1, G,
                            prev_phy2log=old)[0]
    logical = torch.randn(L, E, 5, 3)                           # the true weights of each logical expert
    w = torch.stack([logical[l][old[l]] for l in range(L)])     # [L, R, 5, 3] laid out by the old plan
    b = torch.stack([logical[l, :, 0][old[l]] for l in range(L)])
    if one_layer:
        weights = {"w": w[1].clone(), "b": b[1].clone()}
        before = weights["w"].clone()
        moved = rearrange(weights, old[1], new[1], G)
        assert moved == int((old[1] != new[1]).sum())
        assert torch.equal(weights["w"], logical[1][new[1]]) and torch.equal(weights["b"], logical[1, :, 0][new[1]])
        same = old[1] == new[1]
        assert torch.equal(weights["w"][same], before[same])
    else:
        weights = {"w": w.clone(), "b": b.clone()}
        moved = rearrange(weights, old, new, G)
        assert moved == int((old != new).sum()) > 0
        for l in range(L):
            assert torch.equal(weights["w"][l], logical[l][new[l]])
            assert torch.equal(weights["b"][l], logical[l, :, 0][new[l]])


def test_plan_transfers_prefers_a_local_source():
    old = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    new = torch.tensor([[0, 0, 2, 3, 1, 1, 2, 3]])             # slot 1 <- expert 0, slot 4 <- expert 1
    transfers, moved = plan_transfers(old, new, num_gpus=2)
    assert moved == 2
    assert transfers == [[(0, 1), (5, 4)]]                      # both sources on the destination's GPU
    transfers, _ = plan_transfers(old, torch.tensor([[0, 1, 2, 3, 0, 1, 3, 3]]), num_gpus=2)
    assert transfers == [[(7, 6)]]
    with pytest.raises(ValueError, match="old_phy2log"):
        plan_transfers(old, new[:, :4], 2)


def test_moe_lb_by_hand():
    load = torch.tensor([[10.0, 2, 4, 4]])
    phy2log = torch.tensor([[0, 1, 0, 2, 3, 3]])
    # GPU0: 5 + 2 = 7, GPU1: 5 + 4 = 9, GPU2: 2 + 2 = 4; mean 20/3
    assert moe_lb(load, phy2log, 3).tolist() == pytest.approx([9 / (20 / 3)])
    assert moe_lb_total(torch.stack([load, load]), phy2log, 3) == pytest.approx(9 / (20 / 3))
    assert moe_lb(torch.zeros(1, 4), phy2log, 3).tolist() == [1.0]
    assert identity_phy2log(2, 4, 6).tolist() == [[0, 1, 2, 3, 0, 1]] * 2


def test_plan_file_round_trip_and_mismatches(tmp_path):
    phy2log = _plan(3, 16, 24, 4)[0]
    path = str(tmp_path / "plan.json")
    save_plan(path, phy2log, 4, 16)
    pl = load_plan(path, num_layers=3, num_experts=16)
    assert torch.equal(pl.phy2log, phy2log) and pl.num_gpus == 4 and pl.slots_per_gpu == 6
    with pytest.raises(ValueError, match="num_layers"):
        load_plan(path, num_layers=4, num_experts=16)
    with pytest.raises(ValueError, match="num_logical_experts"):
        load_plan(path, num_layers=3, num_experts=32)
    doc = json.load(open(path))

    def broken(**change):
        d = dict(doc)
        for key, value in change.items():
            if value is None:
                d.pop(key)
            else:
                d[key] = value
        p = str(tmp_path / "broken.json")
        json.dump(d, open(p, "w"))
        return p
    with pytest.raises(ValueError, match="num_gpus"):
        load_plan(broken(num_gpus=5), 3, 16)
    with pytest.raises(ValueError, match="phy2log"):
        load_plan(broken(phy2log=None), 3, 16)
    with pytest.raises(ValueError, match="num_replicas"):
        load_plan(broken(num_replicas=25), 3, 16)
    with pytest.raises(ValueError, match="phy2log"):
        load_plan(broken(phy2log=[[0] * 24] * 3), 3, 16)       # experts 1..15 have no slot
    with pytest.raises(ValueError, match="phy2log"):
        load_plan(broken(phy2log=doc["phy2log"][:2]), 3, 16)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_plan(str(bad), 3, 16)


def test_replan_job_end_to_end(tmp_path, capsys):
    rec = ExpertLoadRecorder(4, 16, 16)
    g = torch.Generator().manual_seed(0)
    p = torch.arange(1, 17, dtype=torch.float) ** -1.2
    for _ in range(16):
        for l in range(4):
            rec.record(l, torch.multinomial(p[torch.randperm(16, generator=g)], 64 * 2, replacement=True,
                                            generator=g).view(64, 2))
        rec.end_step()
    stats = str(tmp_path / "stats.npz")
    rec.dump(stats)
    out1, out2 = str(tmp_path / "p1.json"), str(tmp_path / "p2.json")
    assert replan_main(["--stats", stats, "--num-replicas", "24", "--num-nodes", "2", "--num-gpus", "4",
                        "--num-groups", "4", "--out", out1]) == 0
    text = capsys.readouterr().out
    assert "before (identity)" in text and "moved experts:" in text
    before, after = [float(line.split()[-3]) for line in text.splitlines() if line.startswith(("before", "after"))]
    pl = load_plan(out1, 4, 16)
    total = rec.total()
    assert after == pytest.approx(moe_lb_total(total, pl.phy2log, 4), abs=1e-4)
    assert before == pytest.approx(moe_lb_total(total, identity_phy2log(4, 16, 24), 4), abs=1e-4)
    assert after < before
    assert replan_main(["--stats", stats, "--num-replicas", "24", "--num-nodes", "2", "--num-gpus", "4",
                        "--num-groups", "4", "--prev", out1, "--out", out2]) == 0
    text = capsys.readouterr().out
    assert "before (previous plan)" in text and "moved experts: 0 of 96" in text   # same loads: nothing moves
    assert replan_main(["--stats", stats, "--num-replicas", "20", "--num-nodes", "2", "--num-gpus", "4",
                        "--prev", out1, "--out", out2]) == 2                      # slot count differs from --prev
    assert "num-replicas" in capsys.readouterr().err
