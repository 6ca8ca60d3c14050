"""Writes a finished sweep into docs/benchmarks.md (section "Throughput sweep", or --title) and its plot under docs/.

    python -m examples.sweep.report OUTDIR [--title T] [--png sweep_medium_qwen3_moe.png] [--intro-file F] [--outro-file F]
        [--assumed-acceptance A]   # adds DeepInfer's assumed-tau curve beside measured drafting curves
"""
import argparse
import json
import os
import shutil

from deepinfer.docs import DOC, write_section
from examples.sweep.plot_pareto import plot
from examples.sweep.table import cell, load_points, machine_notes, not_measured, refloor, table

TITLE = "Throughput sweep"


def ratios(points: list[dict], ours: str, peer: str) -> str:
    """Per batch: both engines' ms/step (run back to back) and their ratio."""
    by = {(p["name"], p["decode_num_requests"]): p for p in points}
    rows = [f"| batch | {ours} ms/step | {peer} ms/step | {peer} / {ours} | {ours} time / floor | "
            f"{ours} time / floor beside | load avg (1 min) at the two runs |", "|---|---|---|---|---|---|---|"]
    for b in sorted({p["decode_num_requests"] for p in points}):
        a, h = by.get((ours, b)), by.get((peer, b))
        if a and h:
            rows.append(f"| {b} | {a['decode_step_ms']:.1f} | {h['decode_step_ms']:.1f} | "
                        f"{h['decode_step_ms'] / a['decode_step_ms']:.2f}x | {a['time_over_floor'] or 0:.2f} | "
                        f"{cell(a.get('time_over_floor_beside'), '{:.2f}')} | "
                        f"{a['machine']['load_avg']:.1f} / {h['machine']['load_avg']:.1f} |")
    return "\n".join(rows)


def rates_line(roofline: dict) -> str:
    return ", ".join(f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}: read {r['bandwidth'] / 1e9:.1f} GB/s, "
                     f"matmul (best of fp32, bf16) {r['matmul'] / 1e9:.1f} GFLOP/s" +
                     (f", fp32 {r['matmul_fp32'] / 1e9:.1f} GFLOP/s" if "matmul_fp32" in r else "")
                     for r in roofline["rates"])


def also(outdir: str, text_file: str) -> str:
    """A further shape's table (e.g. medium V4), refloored with its own sweep's rates."""
    pts = load_points(os.path.join(outdir, "points"))
    roof = os.path.join(outdir, "roofline.json")
    if os.path.exists(roof):
        refloor(pts, json.load(open(roof)))
    return open(text_file).read().strip() + "\n\n" + table(pts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--title", default=TITLE, help="the docs/benchmarks.md section to (re)write")
    ap.add_argument("--png", default="sweep_medium_qwen3_moe.png")
    ap.add_argument("--pair", nargs=2, action="append", metavar=("OURS", "PEER"),
                    help="a ratio table of two configurations (repeatable; default: deepinfer-bf16 against "
                         "transformers-bf16)")
    ap.add_argument("--intro-file", help="markdown before the tables (shape, method, commands)")
    ap.add_argument("--outro-file", help="markdown after the plot (caveats, what is left out)")
    ap.add_argument("--assumed-acceptance", type=float)
    ap.add_argument("--also", nargs=2, action="append", default=[], metavar=("OUTDIR", "TEXT_FILE"),
                    help="another sweep's table (no plot) after TEXT_FILE's heading and notes")
    args = ap.parse_args()
    intro, outro = (open(f).read().strip() if f else "" for f in (args.intro_file, args.outro_file))
    pts, missing = load_points(os.path.join(args.outdir, "points")), not_measured(args.outdir)
    roof = json.load(open(os.path.join(args.outdir, "roofline.json")))
    refloor(pts, roof)
    png = os.path.join(os.path.dirname(DOC), args.png)
    plot(pts, png, acceptance=args.assumed_acceptance, title="medium Qwen3-MoE decode, 64-token prompts (labels: batch)")
    pairs = args.pair or [("deepinfer-bf16", "transformers-bf16")]
    body = "\n\n".join(x for x in [
        intro, f"Floor rates (best of the measurements made at the start and end of each run_sweep.sh into this directory): {rates_line(roof)}.",
        *(ratios(pts, ours, peer) for ours, peer in pairs), table(pts), "\n".join(machine_notes(pts)).strip(),
        "\n".join(["Not measured:"] + missing) if missing else "",
        f"![tokens/s per rank against tokens/s per user]({args.png})",
        outro] + [also(d, f) for d, f in args.also] if x)
    write_section(args.title, body)
    print(f"wrote section {args.title!r} of {DOC} and {png}")


if __name__ == "__main__":
    main()
