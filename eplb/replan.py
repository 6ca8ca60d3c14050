"""Replanning job: expert load statistics in, placement plan out.

    python -m eplb.replan --stats STATS.npz --num-replicas R --num-nodes N --num-gpus G \\
        [--num-groups K] [--prev PLAN.json] [--per-step] --out PLAN.json

Prints the predicted moe_lb (max / mean tokens per GPU, on the recorded loads) of the current
placement (the previous plan, else the identity placement: slot s holds expert s mod E) and of the new
plan, and how many expert slots change. The plan JSON is what ``LLM(..., eplb_plan=PLAN.json)`` and
``eplb.placement.load_plan`` read.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from eplb.placement import identity_phy2log, load_plan, moe_lb, moe_lb_total, plan_transfers, save_plan
from eplb.policy import rebalance_experts
from eplb.stats import load_stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eplb.replan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stats", required=True, help=".npz written by ExpertLoadRecorder.dump / llm.dump_expert_load")
    ap.add_argument("--num-replicas", type=int, required=True, help="physical expert slots per layer")
    ap.add_argument("--num-nodes", type=int, required=True)
    ap.add_argument("--num-gpus", type=int, required=True)
    ap.add_argument("--num-groups", type=int, default=1, help="expert groups (hierarchical if nodes divide them)")
    ap.add_argument("--policy", choices=("auto", "hierarchical", "global"), default="auto")
    ap.add_argument("--prev", help="current plan JSON: stay close to it (fewer weight moves)")
    ap.add_argument("--per-step", action="store_true", help="balance per-step peaks, not only window sums")
    ap.add_argument("--allow-duplicates", action="store_true", help="allow two replicas of an expert on one GPU")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    load, meta = load_stats(args.stats)
    if load.shape[0] == 0:
        raise ValueError(f"stats file {args.stats} holds no completed steps")
    steps = torch.from_numpy(load)
    total = steps.sum(0)
    L, E = total.shape
    prev = load_plan(args.prev, L, E).phy2log if args.prev else None
    if prev is not None and prev.shape[1] != args.num_replicas:
        raise ValueError(f"--num-replicas {args.num_replicas} differs from the {prev.shape[1]} slots of --prev")
    before = prev if prev is not None else identity_phy2log(L, E, args.num_replicas)
    t0 = time.perf_counter()
    phy2log, _, _ = rebalance_experts(steps if args.per_step else total, args.num_replicas, args.num_groups,
                                      args.num_nodes, args.num_gpus, prev_phy2log=prev, policy=args.policy,
                                      avoid_duplicates=not args.allow_duplicates)
    ms = (time.perf_counter() - t0) * 1e3
    _, moved = plan_transfers(before, phy2log, args.num_gpus)
    rows = [("before (" + ("previous plan" if prev is not None else "identity") + ")", before), ("after", phy2log)]
    print(f"stats: {load.shape[0]} steps x {L} layers x {E} experts, {int(total.sum())} routed tokens")
    print(f"{'placement':<26} {'moe_lb':>8} {'worst layer':>12} {'peak (per step)':>16}")
    for name, p in rows:
        per_layer = moe_lb(total, p, args.num_gpus)
        print(f"{name:<26} {moe_lb_total(total, p, args.num_gpus):8.4f} {float(per_layer.max()):12.4f} "
              f"{moe_lb_total(steps, p, args.num_gpus):16.4f}")
    print(f"moved experts: {moved} of {L * args.num_replicas} slots; planned in {ms:.1f} ms")
    save_plan(args.out, phy2log, args.num_gpus, E, num_nodes=args.num_nodes, num_groups=args.num_groups,
              predicted_moe_lb=moe_lb_total(total, phy2log, args.num_gpus))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
