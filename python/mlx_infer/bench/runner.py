"""Run trials of several engines, alternating, and collect rows in the results schema."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from .. import defaults
from ..errors import MlxInferError
from .engines import TrialResult

METRICS = ("prompt_tps", "ttft_ms", "decode_tps", "peak_gb")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark setting (the flags of ``mlx_lm.benchmark``)."""

    prompt_tokens: int = 512
    generation_tokens: int = 1024
    batch_size: int = 1
    num_trials: int = 5
    prefill_step_size: int = defaults.PREFILL_STEP_SIZE
    seed: int = 0
    suite: str = "bench"

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "generation_tokens", "batch_size", "num_trials", "prefill_step_size"):
            if getattr(self, name) < 1:
                raise MlxInferError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")


def random_prompts(config: BenchConfig, vocab_size: int) -> list[list[int]]:
    """Random token prompts, the same for every engine (as mlx_lm.benchmark makes them)."""
    key = mx.random.key(config.seed)
    return mx.random.randint(0, vocab_size, (config.batch_size, config.prompt_tokens), key=key).tolist()


def _summary(trials: list[TrialResult]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for m in METRICS:
        values = [getattr(t, m) for t in trials]
        row[m] = statistics.median(values)
        row[f"{m}_min"] = min(values)
        row[f"{m}_max"] = max(values)
    return row


def run_bench(engines: list[Any], config: BenchConfig, *, model_name: str, vocab_size: int,
              progress: bool | None = None,
              on_trial: Callable[[str, int, TrialResult], None] | None = None) -> list[dict[str, Any]]:
    """Warm every engine up, then run ``num_trials`` rounds of A B A B ...; return one row per engine.

    The first engine is the reference of the ratios: each other row gets
    ``ratio_vs_<first>`` with per-trial decode-throughput ratios (first / other)
    and their median. ``progress``: a tqdm bar on stderr over the warm-ups and
    the trials, naming the engine that runs (None: only when stderr is a terminal).
    """
    prompts = random_prompts(config, vocab_size)
    trials: dict[str, list[TrialResult]] = {e.name: [] for e in engines}
    bar = _progress(len(engines) * (config.num_trials + 1), sys.stderr.isatty() if progress is None else progress)
    for e in engines:  # warm-up: compile kernels, fault in weights
        bar.set_description_str(f"warm-up {e.name}")
        e.run(prompts, min(8, config.generation_tokens), config.prefill_step_size)
        bar.update(1)
    for i in range(config.num_trials):
        order = engines if i % 2 == 0 else engines[::-1]  # A B, then B A: drift hits both alike
        for e in order:
            bar.set_description_str(f"trial {i + 1}/{config.num_trials} {e.name}")
            r = e.run(prompts, config.generation_tokens, config.prefill_step_size)
            trials[e.name].append(r)
            if on_trial:
                on_trial(e.name, i, r)
            bar.update(1)
            bar.set_postfix_str(f"{e.name} {r.decode_tps:.1f} tok/s")
    bar.close()
    rows = []
    ref = engines[0].name
    for e in engines:
        row = {
            "suite": config.suite, "model": model_name, "engine": e.name, "batch": config.batch_size,
            "prompt_tokens": config.prompt_tokens, "generation_tokens": config.generation_tokens,
            **_summary(trials[e.name]),
            "trials": [t.to_dict() for t in trials[e.name]],
        }
        if e.name != ref:
            ratios = [a.decode_tps / b.decode_tps if b.decode_tps > 0 else float("nan")
                      for a, b in zip(trials[ref], trials[e.name])]
            prompt_ratios = [a.prompt_tps / b.prompt_tps if b.prompt_tps > 0 else float("nan")
                             for a, b in zip(trials[ref], trials[e.name])]
            row[f"ratio_vs_{ref}"] = {
                "decode_tps": ratios, "decode_tps_median": statistics.median(ratios),
                "prompt_tps": prompt_ratios, "prompt_tps_median": statistics.median(prompt_ratios),
                "meaning": f"{ref} / {e.name}, per trial (above 1: {ref} is faster)",
            }
        rows.append(row)
    return rows


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="warm-up", file=sys.stderr, disable=not enabled, leave=False)


def model_facts(model_dir: Path) -> tuple[str, int]:
    """A short model name and its vocabulary size, from config.json."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return model_dir.name, int(vocab)
