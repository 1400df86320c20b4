"""Structured output: grammar jump on vs off, and the constraint's per-step overhead.

    python benchmarks/structured.py --json results/cpu-structured.json

1. Grammar jump: each schema generated greedily with ``grammar_jump`` on and off; the tokens
   must be identical. Reports forwards per generated token and wall time (median of trials).
2. Overhead, at batch 1 and 32 (see :func:`overhead`): llguidance's masks for the batch
   (``fill_bitmasks``, its thread pool), the batch's mask applied on the device, and what the
   engine's sampling of a step (``engine.rows.sample_rows``) takes more for constrained rows,
   against one engine iteration of that many rows decoding.

    python benchmarks/structured.py --model tiny --only overhead --json results/cpu-structured-tiny.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from structured_schemas import REAL_SUBSET, SCHEMAS  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.bench.report import machine_name, versions, write_json  # noqa: E402
from mlx_infer.bench.report import _commit  # noqa: E402
from mlx_infer.constraints import Constraint, ConstraintState, apply_bitmask, fill_bitmasks  # noqa: E402
from mlx_infer.generation.autoregressive import generate  # noqa: E402

JUMP_SCHEMAS = ["obj_person", "order", "event_log", "obj_many_fields", "classification", "person_free"]
PROMPT = "Give me a JSON example record.\nJSON: "  # plain text: the 270M base model has no chat template


def _median_ms(fn, trials: int) -> float:
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def jump(loaded, trials: int, max_tokens: int) -> list[dict]:
    rows = []
    for name in JUMP_SCHEMAS:
        schema = {**SCHEMAS, **REAL_SUBSET}[name]
        out = {}
        for on in (True, False):
            result = {}

            def run() -> None:
                with generate(loaded, PROMPT, max_tokens=max_tokens, constraint=Constraint.json_schema(schema),
                              grammar_jump=on) as g:
                    result["tokens"] = [t.token for t in g]
                    result["stats"] = g.stats

            run()  # warm-up (compiles the decode step's shapes)
            ms = _median_ms(run, trials)
            s = result["stats"]
            out[on] = {"ms": ms, "tokens": result["tokens"], "generated": s.generated_tokens,
                       "forced": s.forced_tokens, "forwards": s.forwards, "finish": s.finish_reason}
        on, off = out[True], out[False]
        rows.append({"schema": name, "same_tokens": on["tokens"] == off["tokens"], "generated": on["generated"],
                     "forced": on["forced"], "forwards_on": on["forwards"], "forwards_off": off["forwards"],
                     "forwards_per_token_on": on["forwards"] / on["generated"],
                     "forwards_per_token_off": off["forwards"] / off["generated"],
                     "ms_on": on["ms"], "ms_off": off["ms"], "speedup": off["ms"] / on["ms"], "finish": on["finish"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _states(loaded, batch: int, seed: int = 0) -> list[ConstraintState]:
    """``batch`` matchers of the suite's schemas, each 0-11 random allowed tokens in (mid-string, mid-object),
    then past any forced span, so that every row samples."""
    vocab = loaded.model.args.vocab_size
    names = sorted(SCHEMAS)
    rng = np.random.default_rng(seed)
    states = []
    for i in range(batch):
        st = ConstraintState.create(Constraint.json_schema(SCHEMAS[names[i % len(names)]]), loaded.tokenizer, vocab,
                                    loaded.eos_token_ids)
        for _ in range(int(rng.integers(0, 12))):
            if st.done:
                break
            allowed = np.flatnonzero(np.unpackbits(st.bitmask().view(np.uint8), bitorder="little")[:vocab])
            st.advance(int(rng.choice(allowed)))
        while st.forced():  # past forced spans: every row samples (the costly case)
            for t in st.forced():
                st.advance(t, forced=True)
        states.append(st)
    return states


def _rows(loaded, states: list[ConstraintState | None]) -> list[SimpleNamespace]:
    """Engine rows (what ``engine.rows.sample_rows`` reads) sampling at temperature 1, seeded."""
    from mlx_infer.sampling import RequestRNG, SamplingParams, make_sampler

    out = []
    for i, st in enumerate(states):
        p = SamplingParams(temperature=1.0, seed=i)
        out.append(SimpleNamespace(simple=False, constraint=st, needs_history=False, all_ids=[],
                                   sampler=make_sampler(p, eos_token_ids=tuple(loaded.eos_token_ids)),
                                   rng=RequestRNG(i), request=SimpleNamespace(sampling=p)))
    return out


def engine_step_ms(loaded, batch: int, steps: int = 8, prompt_tokens: int = 64) -> float:
    """Median time of one engine iteration with ``batch`` greedy rows decoding (the compiled paged
    step where the model has one; prompts of ``prompt_tokens``; prefill iterations left out)."""
    from mlx_infer.engine import Engine, EngineConfig, EngineRequest

    engine = Engine(loaded, EngineConfig(max_batch=batch, memory_budget_gb=1.0, page_size=16))
    try:
        base = loaded.tokenizer.encode("Give me a JSON example record. " * 16)[:prompt_tokens - 1]
        for i in range(batch):
            engine.submit(EngineRequest(prompt_ids=[10 + i, *base], max_tokens=steps + 3, ignore_eos=True))  # no shared page
        times = []
        while engine.has_work():
            decoding = all(r.state == "decode" for r in engine.scheduler.running) and not engine.scheduler.waiting
            t = time.perf_counter()
            engine.step()
            if decoding and len(engine.scheduler.running) == batch:
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times[1:] or times)
    finally:
        engine.stop()


def overhead(loaded, trials: int) -> dict:
    """Per engine step at batch 1 and 32: the constraint's host and device work against the step.

    * ``mask_ms``: llguidance's masks for the batch (``fill_bitmasks``: its thread pool);
    * ``apply_ms``: the batch's mask applied on the device (``apply_bitmask``, one op);
    * ``sample_extra_ms``: what ``sample_rows`` (the engine's sampling of a step) takes more for
      constrained rows than for the same rows unconstrained (both temperature 1): mask, forced
      check and apply together, the logits already computed;
    * ``engine_step_ms``: one engine iteration of that many greedy rows decoding.

    The mask is computed while the step's forward runs (the forward is queued first), so
    ``sample_extra_ms / engine_step_ms`` is an upper bound of what the constraint adds.
    """
    from mlx_infer.engine.rows import sample_rows

    vocab = loaded.model.args.vocab_size
    out = {"vocab": vocab}
    for batch in (1, 32):
        states = _states(loaded, batch)
        mask_ms = _median_ms(lambda: fill_bitmasks(states), trials * 20)
        bits = fill_bitmasks(states)
        logits = mx.random.normal((batch, vocab))
        mx.eval(logits)
        apply_ms = _median_ms(lambda: mx.eval(apply_bitmask(logits, bits)), trials * 20)
        constrained, free = _rows(loaded, states), _rows(loaded, [None] * batch)

        def sample(rows) -> None:
            tokens, _ = sample_rows(rows, logits)
            mx.eval(tokens)

        sample(constrained), sample(free)
        with_ms = _median_ms(lambda: sample(constrained), trials * 10)
        without_ms = _median_ms(lambda: sample(free), trials * 10)
        step_ms = engine_step_ms(loaded, batch)
        extra = max(0.0, with_ms - without_ms)
        res = {"mask_ms": mask_ms, "apply_ms": apply_ms, "sample_constrained_ms": with_ms,
               "sample_unconstrained_ms": without_ms, "sample_extra_ms": extra, "engine_step_ms": step_ms,
               "overhead_pct": 100 * extra / step_ms, "mask_plus_apply_pct": 100 * (mask_ms + apply_ms) / step_ms}
        out[f"batch{batch}"] = res
        print(json.dumps({"batch": batch, **res}), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded Gemma 3 270M); "
                   "'tiny' builds the tests' tiny random gemma3 config")
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--only", choices=("jump", "overhead"), default=None, help="run one part")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.model == "tiny":
        from tiny import make_tiny_model_dir

        args.model = str(make_tiny_model_dir(Path(tempfile.mkdtemp()), "gemma3"))
    loaded = load_model(args.model)
    doc = {"machine": machine_name(), "versions": versions(), "commit": _commit(),
           "command": " ".join(["python", "benchmarks/structured.py", *sys.argv[1:]]), "model": str(loaded.path)}
    if args.only in (None, "jump"):
        doc["jump"] = jump(loaded, args.num_trials, args.max_tokens)
    if args.only in (None, "overhead"):
        doc["overhead"] = overhead(loaded, args.num_trials)
    if args.json:
        write_json(doc, Path(args.json))


if __name__ == "__main__":
    main()
