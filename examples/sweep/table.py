"""Prints a sweep's points as a markdown table, each with its time over this machine's floor (at the sweep's best
rates, and at the rates read right after the point's run: floor beside), then what was not measured and why.

    python -m examples.sweep.table OUTDIR
"""
import glob
import json
import os
import statistics
import sys

from examples.sweep.metrics import floor_ms, per_rank_tps, per_user_tps, time_over_floor
from examples.sweep.roofline import matmul_for, rates_for


def median_point(rounds: list[dict]) -> dict:
    """One point from its rounds: the median step time (mean of the middle two for an even count), the
    rates rederived from it, the median of the rounds' times over their own floor beside (None where no round has
    one); the rest (split, prefill, machine) from the lower-middle round."""
    by_ms = sorted(rounds, key=lambda p: p["decode_step_ms"])
    p = dict(by_ms[(len(by_ms) - 1) // 2])
    ms = statistics.median(r["decode_step_ms"] for r in rounds)
    sps, tokens = 1000 / ms, p.get("accepted_tokens_per_step") or 1.0
    p.update(decode_step_ms=ms, decode_avg_sps=sps, tokens_per_s_per_user=per_user_tps(sps, tokens),
             tokens_per_s_per_rank=per_rank_tps(sps, p["decode_num_requests"], p["dp"], tokens),
             rounds_ms=[r["decode_step_ms"] for r in sorted(rounds, key=lambda r: r.get("round", 1))])
    beside = [r["time_over_floor_beside"] for r in rounds if r.get("time_over_floor_beside")]
    p["time_over_floor_beside"] = statistics.median(beside) if beside else None
    if p.get("floor"):
        p["time_over_floor"] = time_over_floor(ms, p["floor"]["ms"])
    return p


def load_points(points_dir: str) -> list[dict]:
    """Every point under points_dir, its rounds merged by median_point, in (configuration, parallel
    size, batch) order."""
    groups: dict[tuple, list[dict]] = {}
    for f in glob.glob(os.path.join(points_dir, "*.json")):
        p = json.load(open(f))
        groups.setdefault((p["name"], p["dp"], p["decode_num_requests"]), []).append(p)
    return [median_point(groups[k]) for k in sorted(groups)]


def not_measured(outdir: str) -> list[str]:
    """Configurations the sweep left out (run_sweep.sh's list step) and points whose run failed."""
    path = os.path.join(outdir, "not_measured.json")
    left_out = json.load(open(path)) if os.path.exists(path) else {}
    lines = [f"- {name}: {why}" for name, why in sorted(left_out.items())]
    for f in sorted(glob.glob(os.path.join(outdir, "points", "*.failed"))):
        why = open(f).read().strip().splitlines() or ["no reason recorded"]
        lines.append(f"- {os.path.basename(f)[:-len('.failed')]}: {why[-1]}")
    return lines


def refloor(points: list[dict], roofline: dict) -> None:
    """Recomputes each point's floor from its bytes and FLOPs with the sweep's final (best) rates."""
    for p in points:
        fl = p.get("floor")
        if fl:
            r = rates_for(roofline, fl["threads"])
            # Points measured before floors named their weights' dtype were all bf16.
            matmul = matmul_for(r, fl.get("fp32_weights", False))
            fl.update(floor_ms(fl["bytes"], fl["flops"], r["bandwidth"], matmul), bandwidth=r["bandwidth"],
                      matmul_rate=matmul)
            p["time_over_floor"] = time_over_floor(p["decode_step_ms"], fl["ms"])


def cell(x, fmt="{:.1f}") -> str:
    """x formatted for a table cell, "-" for None."""
    return "-" if x is None else fmt.format(x)


def row(p: dict) -> str:
    s, fl = p.get("step_split_ms"), p.get("floor")
    split = " / ".join(f"{s[k]:.1f}" for k in ("draft", "schedule", "prepare", "forward", "sampling", "output")) if s else "-"
    pre = p["prefill"][0] if p.get("prefill") else None
    rounds = " / ".join(f"{ms:.1f}" for ms in p.get("rounds_ms", [p["decode_step_ms"]]))
    return (f"| {p['name']} | {p['dp']} | {p['decode_num_requests']} | {p['decode_step_ms']:.1f} | {rounds} | "
            f"{p['decode_avg_sps']:.2f} | {p['tokens_per_s_per_user']:.2f} | {p['tokens_per_s_per_rank']:.1f} | "
            f"{cell(p.get('accepted_tokens_per_step'), '{:.2f}')} | {cell(fl and fl['ms'])} | "
            f"{cell(p.get('time_over_floor'), '{:.2f}x')} | {cell(p.get('time_over_floor_beside'), '{:.2f}x')} | {split} | "
            f"{cell(pre and pre['tokens_per_s'], '{:.0f}')} @ {cell(pre and pre['tokens_per_step'], '{:.0f}')} |")


def table(points: list[dict]) -> str:
    head = ("| configuration | ranks | batch | decode ms/step (median) | ms/step per round | steps/s | "
            "tok/s per user | tok/s per rank | "
            "accepted tok/step | floor ms | time / floor | time / floor beside | "
            "draft / schedule / prep / forward / sampling / output ms | prefill tok/s @ tok/step |")
    return "\n".join([head, "|" + "---|" * 14] + [row(p) for p in points])


def draws(p: dict) -> str:
    """How a point's decode steps drew their tokens (points written before the sweep could sample: greedy)."""
    sampling = p.get("sampling") or {}
    return "sampled (" + ", ".join(f"{k} {v}" for k, v in sorted(sampling.items())) + ")" if sampling else "greedy"


def machine_notes(pts: list[dict]) -> list[str]:
    """The CPU flags the points ran on, how they drew tokens, and the GEMM paths deepinfer's plan chose (from its
    last point)."""
    flags = sorted({p["machine"].get("flags") or p["machine"].get("cpu", "unknown CPU") for p in pts})
    plans = [p["gemm_plan"] for p in pts if p.get("gemm_plan")]
    lines = ["", "CPU: " + "; ".join(flags)] if flags else []
    lines += ["", "Decode tokens drawn: " + "; ".join(sorted({draws(p) for p in pts}))] if pts else []
    if plans:
        lines += ["", "deepinfer's GEMM plan (shape: rows -> path):"] + [f"- {line}" for line in plans[-1]]
    return lines


def main(argv: list[str]) -> int:
    pts, missing = load_points(os.path.join(argv[0], "points")), not_measured(argv[0])
    if not pts and not missing:
        print(f"no points under {argv[0]}/points", file=sys.stderr)
        return 1
    roof = os.path.join(argv[0], "roofline.json")
    if os.path.exists(roof):
        refloor(pts, json.load(open(roof)))
    print(table(pts) if pts else "No point measured.")
    for line in machine_notes(pts):
        print(line)
    if missing:
        print("\nNot measured:\n" + "\n".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
