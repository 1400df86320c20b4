"""The results schema shared by every suite, and its markdown and PNG renderings."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_SCHEMA_KEYS = ("machine", "date", "commit", "versions", "command", "rows")
ROW_KEYS = ("suite", "model", "engine", "batch", "prompt_tokens", "generation_tokens",
            "prompt_tps", "ttft_ms", "decode_tps", "peak_gb", "trials")


def machine_name() -> str:
    """CPU model, core count and MLX device, e.g. ``AMD EPYC 9R14 (2 cores), mlx cpu``."""
    import os

    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = mx.default_device()
    name = f"{cpu} ({os.cpu_count()} cores), mlx {device.type.name}"
    if device.type.name == "gpu":
        try:
            name += f" [{mx.device_info().get('device_name', '')}]"
        except Exception:
            pass
    return name


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    """Versions of Python and of the packages a result depends on (absent ones omitted)."""
    out = {"python": platform.python_version()}
    for dist in ("mlx", "mlx-infer", "mlx-lm", "llama-cpp-python", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def results_document(rows: list[dict[str, Any]], *, command: str | None = None) -> dict[str, Any]:
    """Wrap rows in the results schema (machine, date, commit, versions, command)."""
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        assert not missing, f"result row lacks {missing}"
    return {
        "machine": machine_name(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _commit(),
        "versions": versions(),
        "command": command if command is not None else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "rows": rows,
    }


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def write_markdown(doc: dict[str, Any], path: Path | None = None) -> str:
    """A markdown table of the rows (median [min–max]); written to ``path`` when given."""
    lines = [
        f"**{doc['machine']}** · {doc['date']} · commit `{doc['commit']}` · "
        + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()),
        "",
        f"`{doc['command']}`",
        "",
        "| suite | model | engine | batch | prompt | gen | prompt tok/s | TTFT ms | decode tok/s | peak GB | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        ratio = next((v for k, v in r.items() if k.startswith("ratio_vs_")), None)
        ratio_s = f"{ratio['decode_tps_median']:.2f}× decode" if ratio else "—"

        def rng(m: str, fmt: str) -> str:
            if f"{m}_min" in r:
                return f"{r[m]:{fmt}} [{r[m + '_min']:{fmt}}–{r[m + '_max']:{fmt}}]"
            return f"{r[m]:{fmt}}"

        lines.append(
            f"| {r['suite']} | {r['model']} | {r['engine']} | {r['batch']} | {r['prompt_tokens']} | "
            f"{r['generation_tokens']} | {rng('prompt_tps', '.1f')} | {rng('ttft_ms', '.0f')} | "
            f"{rng('decode_tps', '.2f')} | {r['peak_gb']:.2f} | {ratio_s} |"
        )
    text = "\n".join(lines) + "\n"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text


def write_plot(doc: dict[str, Any], path: Path, *, x: str = "engine") -> None:
    """Bar charts of decode and prompt tokens/s per engine (or lines over ``x`` = batch/prompt_tokens)."""
    try:
        import matplotlib
    except ImportError:
        from ..errors import MlxInferError

        raise MlxInferError("--plot needs matplotlib: pip install 'mlx-infer[bench]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "decode_tps", "decode tokens/s"), (axes[1], "prompt_tps", "prompt tokens/s")):
        if x == "engine":
            values = [next(r[metric] for r in rows if r["engine"] == e) for e in engines]
            lo = [v - next(r[f"{metric}_min"] for r in rows if r["engine"] == e) for v, e in zip(values, engines)]
            hi = [next(r[f"{metric}_max"] for r in rows if r["engine"] == e) - v for v, e in zip(values, engines)]
            bars = ax.bar(engines, values, yerr=[lo, hi], capsize=6, color=["#1f77b4", "#ff7f0e", "#2ca02c"][: len(engines)])
            ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], label_type="center", color="white",
                         fontweight="bold")
            ax.set_ylim(0, max(v + h for v, h in zip(values, hi)) * 1.1)
            ax.set_xlabel("engine")
        else:
            for e in engines:
                pts = sorted((r[x], r[metric]) for r in rows if r["engine"] == e)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=e)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(x.replace("_", " "))
            ax.legend()
        ax.set_ylabel(label)
        ax.set_title(label + " (median, min–max)")
        ax.grid(axis="y", alpha=0.3)
    r0 = rows[0]
    fig.suptitle(f"{r0['model']} · prompt {r0['prompt_tokens']} · gen {r0['generation_tokens']} · batch {r0['batch']}\n"
                 f"{doc['machine']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
