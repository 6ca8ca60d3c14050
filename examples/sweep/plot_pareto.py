"""Tokens/s per rank (y) against tokens/s per user (x), one curve per configuration.

    python -m examples.sweep.plot_pareto POINTS_DIR --out pareto.png [--assumed-tau T | --assumed-acceptance A]

Both axes use tokens per step as measured (`accepted_tokens_per_step`; 1 without drafting). DeepInfer's
own plot multiplies both by an input tau = 1 + nextn x a; here that is only drawn on request, for
curves that ran with drafts, dashed and labelled "assumed", beside the measured curve."""
import argparse
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from examples.sweep.metrics import per_rank_tps, per_user_tps, tau_from_acceptance  # noqa: E402
from examples.sweep.table import load_points  # noqa: E402


def curves(points: list[dict]) -> dict[str, list[dict]]:
    """Points grouped by configuration (and parallel size when above 1), sorted by batch."""
    out: dict[str, list[dict]] = {}
    for p in points:
        label = p["name"] + (f" (DP{p['dp']})" if p["dp"] > 1 else "")
        out.setdefault(label, []).append(p)
    return {k: sorted(v, key=lambda p: p["decode_num_requests"]) for k, v in out.items()}


def measured_xy(pts: list[dict]) -> tuple[list[float], list[float]]:
    return [p["tokens_per_s_per_user"] for p in pts], [p["tokens_per_s_per_rank"] for p in pts]


def assumed_tau(p: dict, tau: float | None, acceptance: float | None) -> float | None:
    """The assumed tokens per step for a point that ran with drafts (None: no assumed curve)."""
    if not p.get("nextn"):
        return None
    if tau is not None:
        return tau
    return tau_from_acceptance(p["nextn"], acceptance) if acceptance is not None else None


def assumed_xy(pts: list[dict], tau: float | None, acceptance: float | None):
    """DeepInfer's axes: steps/s x assumed tau. None unless every point of the curve has drafts."""
    taus = [assumed_tau(p, tau, acceptance) for p in pts]
    if any(t is None for t in taus):
        return None
    xs = [per_user_tps(p["decode_avg_sps"], t) for p, t in zip(pts, taus)]
    ys = [per_rank_tps(p["decode_avg_sps"], p["decode_num_requests"], p["dp"], t) for p, t in zip(pts, taus)]
    return xs, ys, taus


def plot(points: list[dict], out: str, tau: float | None = None, acceptance: float | None = None, title: str = "") -> list[str]:
    """Draws the PNG; returns the legend labels (tests check what the legend claims)."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    labels = []
    for name, pts in curves(points).items():
        xs, ys = measured_xy(pts)
        acc = [p["accepted_tokens_per_step"] for p in pts if p.get("accepted_tokens_per_step") is not None]
        label = name + (f" (measured {min(acc):.2f}-{max(acc):.2f} tok/step)" if acc else "")
        line, = ax.plot(xs, ys, "o-", label=label)
        labels.append(label)
        for x, y, p in zip(xs, ys, pts):
            ax.annotate(str(p["decode_num_requests"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        assumed = assumed_xy(pts, tau, acceptance)
        if assumed:
            ax.plot(assumed[0], assumed[1], "s--", color=line.get_color(), alpha=0.6,
                    label=f"{name} (ASSUMED tau={assumed[2][0]:.2f}, not measured)")
            labels.append(ax.get_legend_handles_labels()[1][-1])
        elif tau is not None or acceptance is not None:
            print(f"plot_pareto: {name} ran without drafts; no assumed-tau curve drawn for it", file=sys.stderr)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    sparse = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}".lstrip("0.")[:1] in ("2", "5") else "")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(sparse)  # 2 and 5 between decades: readable without crowding
    ax.set_xlabel("tokens/s per user (measured tokens per step)")
    ax.set_ylabel("tokens/s per rank")
    ax.set_title(title or "decode throughput (labels: requests in the batch)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return labels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("points_dir")
    ap.add_argument("--out", default="pareto.png")
    ap.add_argument("--title", default="")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--assumed-tau", type=float, help="draw an extra, labelled curve at this tokens per step")
    g.add_argument("--assumed-acceptance", type=float, help="DeepInfer's tau = 1 + nextn x a, per point")
    args = ap.parse_args(argv)
    pts = load_points(args.points_dir)
    if not pts:
        print(f"plot_pareto: no points in {args.points_dir}", file=sys.stderr)
        return 1
    plot(pts, args.out, args.assumed_tau, args.assumed_acceptance, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
