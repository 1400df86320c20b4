"""Structured output: grammar jump on vs off, and the constraint's per-step overhead.

    python benchmarks/structured.py --json results/cpu-structured.json

1. Grammar jump: each schema generated greedily with ``grammar_jump`` on and off; the tokens
   must be identical. Reports forwards per generated token and wall time (median of trials).
2. Overhead: llguidance's mask for one row and for a batch of 32 (``fill_bitmasks``, its
   thread pool), and applying a (32, vocab) mask on the device, against one eager decode step
   at batch 32 of the same model (32 rows after a 64-token prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from structured_schemas import REAL_SUBSET, SCHEMAS  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.bench.report import write_json  # noqa: E402
from mlx_infer.constraints import Constraint, ConstraintState, apply_bitmask, fill_bitmasks  # noqa: E402
from mlx_infer.generation.autoregressive import generate  # noqa: E402

JUMP_SCHEMAS = ["obj_person", "order", "event_log", "obj_many_fields", "classification", "person_free"]
PROMPT = [{"role": "user", "content": "Give me a JSON example record."}]


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


def overhead(loaded, trials: int) -> dict:
    vocab = loaded.model.args.vocab_size
    names = sorted(SCHEMAS)
    states = []
    rng = np.random.default_rng(0)
    for i in range(32):  # each state 0-11 random allowed tokens into its output: mid-string, mid-object
        st = ConstraintState.create(Constraint.json_schema(SCHEMAS[names[i % len(names)]]), loaded.tokenizer, vocab,
                                    loaded.eos_token_ids)
        for _ in range(int(rng.integers(0, 12))):
            if st.done:
                break
            allowed = np.flatnonzero(np.unpackbits(st.bitmask().view(np.uint8), bitorder="little")[:vocab])
            st.advance(int(rng.choice(allowed)))
        states.append(st)
    one_ms = _median_ms(lambda: fill_bitmasks(states[:1]), trials * 20)
    batch_ms = _median_ms(lambda: fill_bitmasks(states), trials * 20)
    bits = fill_bitmasks(states)
    logits = mx.random.normal((32, vocab))
    mx.eval(logits)
    apply_ms = _median_ms(lambda: mx.eval(apply_bitmask(logits, bits)), trials * 20)

    model = loaded.model
    cache = model.make_cache()
    model(mx.zeros((32, 64), dtype=mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.zeros((32, 1), dtype=mx.uint32)

    def step() -> None:
        mx.eval(model(y, cache=cache))

    step()
    decode_ms = _median_ms(step, trials * 5)
    res = {"vocab": vocab, "mask_ms_batch1": one_ms, "mask_ms_batch32": batch_ms, "apply_ms_batch32": apply_ms,
           "decode_step_ms_batch32": decode_ms,
           "overhead_batch32_pct": 100 * (batch_ms + apply_ms) / decode_ms,
           "overhead_batch1_pct_of_b32_step": 100 * one_ms / decode_ms}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded Gemma 3 270M)")
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    loaded = load_model(args.model)
    doc = {"model": str(loaded.path), "jump": jump(loaded, args.num_trials, args.max_tokens),
           "overhead": overhead(loaded, args.num_trials)}
    if args.json:
        write_json(doc, Path(args.json))


if __name__ == "__main__":
    main()
