"""The figures of the report, the benchmarks and calibration, drawn with matplotlib's object API (no pyplot
state) and returned as PNG bytes. A base module (like errors.py): it imports nothing of the package.

Every function takes plain JSON data (rows of profile/sps.json, a calibration.json, a benchmark result)
and returns the PNG as bytes, so the caller decides where it goes (a file next to the HTML page, a
data URI inside it, both).
"""

from __future__ import annotations

import io
import math

import numpy as np

__all__ = ["latency_figure", "sps_figure", "drafter_figure", "reliability_figure", "ece_figure",
           "acceptance_figure", "serve_figure", "peers_figure", "MIN_BIN_COUNT"]

#: bins with fewer rounds than this are left out of the reliability diagram (their rate is noise)
MIN_BIN_COUNT = 5
DPI = 110


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _log2_axis(ax, values: list[int], label: str) -> None:
    if len(values) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.set_xticklabels([str(v) for v in values])
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def _spread(ax, xs, rows: list[dict], label: str, color: str | None = None) -> None:
    """Median with a p10-p90 bar per point (ms)."""
    med = np.array([r["median_ms"] for r in rows], float)
    lo = med - np.array([r["p10_ms"] for r in rows], float)
    hi = np.array([r["p90_ms"] for r in rows], float) - med
    ax.errorbar(xs, med, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], marker="o", ms=4, capsize=3, label=label,
                color=color)


def latency_figure(target_rows: list[dict], context_len: int | None) -> bytes:
    """Target step latency (median, p10-p90 bars) vs bucket B. Rows: {"B", "median_ms", "p10_ms", "p90_ms"}."""
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    bs = [int(r["B"]) for r in target_rows]
    _spread(ax, bs, target_rows, "median (bars: p10–p90)")
    _log2_axis(ax, bs, "bucket B (verification tokens per step)")
    ax.set_ylabel("target step latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Target latency per bucket{f' at context {context_len}' if context_len else ''}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig)


def sps_figure(buckets, steps_per_s, every, curve, interpolated: bool = False) -> bytes:
    """SPS of each bucket (points) and the SPS(B) the scheduler reads for every B (the caller computes it with
    `engines.sps.ThroughputProfile`: the fastest bucket ≥ B, a staircase, or with `interpolated` the latency
    interpolated between buckets).

    Args:
        buckets, steps_per_s: [n] the measured buckets B and their SPS (steps/s).
        every, curve: [m] every B = 1..max bucket and SPS(B) there.
        interpolated: draw the curve as a line rather than as steps.
    """
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    if interpolated:
        ax.plot(every, curve, lw=1.6, label="SPS(B) used by the scheduler")
    else:
        ax.step(every, curve, where="post", lw=1.6, label="SPS(B) used by the scheduler")
    ax.plot(buckets, steps_per_s, "o", ms=5, label="measured per bucket (1000 / median ms)")
    _log2_axis(ax, list(buckets), "verification tokens B")
    ax.set_ylabel("target steps per second")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput profile SPS(B) ({'interpolated' if interpolated else 'staircase'})", fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


def drafter_figure(drafter_rows: list[dict]) -> bytes:
    """Drafter-block latency (median, p10-p90 bars) vs request count R. Rows: {"R", "median_ms", ...}."""
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    rs = [int(r["R"]) for r in drafter_rows]
    _spread(ax, rs, drafter_rows, "median (bars: p10–p90)", color="tab:green")
    _log2_axis(ax, rs, "requests R (drafter block bucket)")
    ax.set_ylabel("drafter block latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Drafter latency per request count", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig)


def reliability_figure(reliability: dict) -> bytes:
    """Per draft position: observed vs predicted survival before (T = 1) and after STS.

    Args:
        reliability: `training.calibration.reliability_bins` output.
    """
    positions = reliability["positions"]
    cols = min(4, len(positions))
    rows = math.ceil(len(positions) / cols)
    fig = _figure(2.7 * cols, 2.7 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)).ravel()
    for ax, pos in zip(axes, positions):
        for label, style, color in (("raw", "--", "tab:gray"), ("sts", "-", "tab:blue")):
            curve = pos.get(label)
            if not curve:
                continue
            keep = [i for i, n in enumerate(curve["count"]) if n >= MIN_BIN_COUNT]
            xs, ys = [curve["predicted"][i] for i in keep], [curve["observed"][i] for i in keep]
            counts = np.array([curve["count"][i] for i in keep], float)
            ax.plot(xs, ys, style, lw=0.9, color=color,
                    label=f"{'T=1' if label == 'raw' else 'STS'} (ECE {curve['ece']:.3f})")
            if len(counts):  # marker area ∝ rounds in the bin: sparse bins look sparse
                ax.scatter(xs, ys, s=4 + 60 * np.sqrt(counts / counts.sum()), color=color, zorder=3)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set_title(f"position {pos['position']}", fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(positions):]:
        ax.set_visible(False)
    for ax in axes[::cols]:
        ax.set_ylabel("observed survival")
    for ax in axes[(rows - 1) * cols:]:
        ax.set_xlabel("predicted survival")
    fig.suptitle(f"Reliability diagram ({reliability['rounds']} rounds, {reliability['bins']} bins; marker area ∝ "
                 f"rounds in the bin; bins with < {MIN_BIN_COUNT} rounds omitted)", fontsize=9)
    return _png(fig)


def ece_figure(ece_before: list[float] | None, ece_after: list[float]) -> bytes:
    """ECE of the survival per draft position, before (T = 1) and after STS (bars)."""
    fig = _figure(6.4, 3.6)
    ax = fig.add_subplot()
    pos = np.arange(1, len(ece_after) + 1)
    width = 0.38
    if ece_before:
        ax.bar(pos - width / 2, ece_before, width, label="T = 1 (raw)", color="tab:gray")
    ax.bar(pos + (width / 2 if ece_before else 0), ece_after, width, label="STS", color="tab:blue")
    ax.set_xticks(pos)
    ax.set_xlabel("draft position")
    ax.set_ylabel("ECE")
    ax.set_title("Calibration error of the survival per position", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def acceptance_figure(result: dict) -> bytes:
    """`bench acceptance` result: τ per dataset (bars) and conditional acceptance per position (lines)."""
    fig = _figure(9.6, 3.9)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.2]})
    names = list(result["datasets"])
    left.bar(range(len(names)), [result["datasets"][n]["acceptance_length"] for n in names], color="tab:blue")
    left.set_xticks(range(len(names)))
    left.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel("acceptance length τ (bonus included)")
    left.set_title(f"τ per dataset, {result.get('policy', '?')}", fontsize=10)
    left.grid(True, axis="y", alpha=0.3)
    positions = list(range(1, int(result["block_size"]) + 1))
    for name, values in result.get("conditional_acceptance", {}).items():
        right.plot(positions, [math.nan if v is None else v for v in values], marker="o", ms=3, label=name)
    right.set_xticks(positions)
    right.set_ylim(-0.02, 1.02)
    right.set_xlabel("draft position")
    right.set_ylabel("conditional acceptance rate")
    right.set_title("Conditional acceptance per position", fontsize=10)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7, ncol=2)
    return _png(fig)


def serve_figure(result: dict) -> bytes:
    """`bench serve` result: throughput vs per-user tokens/s per policy (one point per concurrency)."""
    fig = _figure(6.8, 4.4)
    ax = fig.add_subplot()
    by_policy: dict[str, list[dict]] = {}
    for row in result["results"]:
        by_policy.setdefault(row["policy"], []).append(row)
    for policy, rows in by_policy.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        x = [r["per_user_tokens_per_s"] for r in rows]
        y = [r["throughput_tokens_per_s"] for r in rows]
        (line,) = ax.plot(x, y, marker="o", label=policy)
        for r, xi, yi in zip(rows, x, y):
            ax.annotate(f"C={r['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=line.get_color())
    ax.set_xlabel("per-user tokens/s (mean)")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("Serving: throughput vs per-user speed", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def peers_figure(result: dict) -> bytes:
    """`bench peers` result: single-user tokens/s per system (horizontal bars, ratio to `ar` annotated)."""
    rows = [r for r in result["results"] if r.get("tokens_per_s")]
    fig = _figure(7.2, 0.5 * len(rows) + 1.4)
    ax = fig.add_subplot()
    ys = np.arange(len(rows))[::-1]
    ax.barh(ys, [r["tokens_per_s"] for r in rows],
            color=["tab:blue" if r["system"].startswith(("dspark-export", "DSpark")) else "tab:gray" for r in rows])
    for y, r in zip(ys, rows):
        ratio = r.get("ratio_to_ar")
        ax.annotate(f"{r['tokens_per_s']:.1f}" + (f"  (×{ratio:.2f} ar)" if ratio else ""), (r["tokens_per_s"], y),
                    textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([r["system"] for r in rows], fontsize=8)
    ax.set_xlabel("single-user tokens/s (greedy)")
    ax.set_xlim(0, max([r["tokens_per_s"] for r in rows] + [1]) * 1.3)
    ax.set_title("Peer benchmark (same prompts, same run)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    return _png(fig)
