"""Prints a sweep's points as a markdown table, each with its time over this machine's floor.

    python -m examples.sweep.table OUTDIR
"""
import glob
import json
import os
import sys

from examples.sweep.metrics import floor_ms, time_over_floor
from examples.sweep.roofline import rates_for


def load_points(points_dir: str) -> list[dict]:
    """Every point JSON under points_dir, in (configuration, parallel size, batch) order."""
    pts = [json.load(open(f)) for f in glob.glob(os.path.join(points_dir, "*.json"))]
    return sorted(pts, key=lambda p: (p["name"], p["dp"], p["decode_num_requests"]))


def refloor(points: list[dict], roofline: dict) -> None:
    """Recomputes each point's floor from its bytes and FLOPs with the sweep's final (best) rates."""
    for p in points:
        fl = p.get("floor")
        if fl:
            r = rates_for(roofline, fl["threads"])
            fl.update(floor_ms(fl["bytes"], fl["flops"], r["bandwidth"], r["matmul"]),
                      bandwidth=r["bandwidth"], matmul_rate=r["matmul"])
            p["time_over_floor"] = time_over_floor(p["decode_step_ms"], fl["ms"])


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def row(p: dict) -> str:
    s, fl = p.get("step_split_ms"), p.get("floor")
    split = " / ".join(f"{s[k]:.1f}" for k in ("draft", "schedule", "prepare", "forward", "sampling", "output")) if s else "-"
    pre = p["prefill"][0] if p.get("prefill") else None
    return (f"| {p['name']} | {p['dp']} | {p['decode_num_requests']} | {p['decode_step_ms']:.1f} | "
            f"{p['decode_avg_sps']:.2f} | {p['tokens_per_s_per_user']:.2f} | {p['tokens_per_s_per_rank']:.1f} | "
            f"{_f(p.get('accepted_tokens_per_step'), '{:.2f}')} | {_f(fl and fl['ms'])} | "
            f"{_f(p.get('time_over_floor'), '{:.2f}x')} | {split} | "
            f"{_f(pre and pre['tokens_per_s'], '{:.0f}')} @ {_f(pre and pre['tokens_per_step'], '{:.0f}')} |")


def table(points: list[dict]) -> str:
    head = ("| configuration | ranks | batch | decode ms/step | steps/s | tok/s per user | tok/s per rank | "
            "accepted tok/step | floor ms | time / floor | draft / schedule / prep / forward / sampling / output ms | "
            "prefill tok/s @ tok/step |")
    return "\n".join([head, "|" + "---|" * 12] + [row(p) for p in points])


def main(argv: list[str]) -> int:
    pts = load_points(os.path.join(argv[0], "points"))
    if not pts:
        print(f"no points under {argv[0]}/points", file=sys.stderr)
        return 1
    roof = os.path.join(argv[0], "roofline.json")
    if os.path.exists(roof):
        refloor(pts, json.load(open(roof)))
    print(table(pts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
