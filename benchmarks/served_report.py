"""benchmarks/served.py's report: the TTFT percentiles, the markdown table RESULTS.md shows, the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (linear between the nearest ranks); 0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table RESULTS.md shows: per stream count and engine."""
    out = ["| streams | engine | tokens/s end to end | vs mlx-lm | decode-only tokens/s | vs mlx-lm | "
           "TTFT p50 ms | TTFT p95 ms | peak GB (process / own) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, dr, pk = r["decode_only_tps"], r["decode_only_ratio_vs_mlx-lm"], r["peak_gb"]
        own = r.get("own_peak_gb")
        out.append(f"| {r['batch']} | {r['engine']} | {r['decode_tps']:.1f} | {r['ratio_vs_mlx-lm']:.2f}x | "
                   f"{f'{d:.1f}' if d else '-'} | {f'{dr:.2f}x' if dr else '-'} | {r['ttft_p50_ms']:.1f} | "
                   f"{r['ttft_p95_ms']:.1f} | {f'{pk:.2f}' if pk is not None else '-'} / "
                   f"{f'{own:.2f}' if own is not None else '-'} |")
    return "\n".join(out)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Tokens/s (end to end) and TTFT p50/p95 over the stream counts, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for e in dict.fromkeys(r["engine"] for r in rows):
        pts = sorted((r["batch"], r["decode_tps"], r["ttft_p50_ms"], r["ttft_p95_ms"]) for r in rows if r["engine"] == e)
        xs = [p[0] for p in pts]
        a.plot(xs, [p[1] for p in pts], marker="o", label=e)
        line, = b.plot(xs, [p[2] for p in pts], marker="o", label=f"{e} p50")
        b.plot(xs, [p[3] for p in pts], marker="x", linestyle="--", color=line.get_color(), label=f"{e} p95")
    for ax, label in ((a, "tokens/s, end to end"), (b, "TTFT ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    b.set_yscale("log")
    r0 = rows[0]
    fig.suptitle(f"served: {r0['model']} · prompt {r0['prompt_tokens']} · gen {r0['generation_tokens']}\n"
                 f"{doc['machine']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
