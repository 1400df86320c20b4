"""Structured output: grammar jump on vs off, and the constraint's per-step overhead.

    python benchmarks/structured.py --json results/cpu-structured.json

1. Grammar jump: each schema generated greedily with ``grammar_jump`` on and off; the tokens
   must be identical. Reports forwards per generated token and wall time (median of trials).
2. Overhead, at batch 1 and 32 (see :func:`overhead`): llguidance's masks for the batch
   (``fill_bitmasks``, its thread pool), the batch's mask applied on the device, what the
   engine's sampling of a step (``engine.rows.sample_rows``) takes more for constrained rows
   (greedy; temperature 1 for reference) and each row's ``advance``, against one engine
   iteration of that many greedy rows decoding.

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


def _rows(loaded, states: list[ConstraintState | None], temperature: float) -> list[SimpleNamespace]:
    """Engine rows (what ``engine.rows.sample_rows`` reads), seeded; ``simple`` as the engine sets it."""
    from mlx_infer.sampling import RequestRNG, SamplingParams, make_sampler

    out = []
    for i, st in enumerate(states):
        p = SamplingParams(temperature=temperature, seed=i)
        out.append(SimpleNamespace(simple=p.greedy and st is None, constraint=st, needs_history=False, all_ids=[],
                                   sampler=make_sampler(p, eos_token_ids=tuple(loaded.eos_token_ids)),
                                   rng=RequestRNG(i), request=SimpleNamespace(sampling=p)))
    return out


#: A constraint that leaves the model a choice at every step (nothing forced) and ends only after
#: a "~" (which no model here picks within a benchmark's steps), with a cheap mask: the costly
#: case for the engine (every row masked and sampled every step). A long ``minLength`` string
#: schema would do the same with a mask llguidance takes ~20 ms to compute for 32 rows.
FREE_TEXT = Constraint.regex(r"[a-zA-Z0-9 ,.!?'-]*~")


def engine_step_ms(loaded, batch: int, steps: int = 8, prompt_tokens: int = 64,
                   constraint: Constraint | None = None) -> float:
    """Median time of one engine iteration with ``batch`` greedy rows decoding (the compiled paged
    step where the model has one; prompts of ``prompt_tokens``; prefill iterations left out), each
    row under ``constraint`` when given."""
    from mlx_infer.engine import Engine, EngineConfig, EngineRequest

    engine = Engine(loaded, EngineConfig(max_batch=batch, memory_budget_gb=1.0, page_size=16))
    try:
        base = loaded.tokenizer.encode("Give me a JSON example record. " * 16)[:prompt_tokens - 1]
        for i in range(batch):
            engine.submit(EngineRequest(prompt_ids=[10 + i, *base], max_tokens=steps + 3, ignore_eos=True,
                                        constraint=constraint))  # no shared page
        times = []
        while engine.has_work():
            decoding = all(r.state == "decode" for r in engine.scheduler.running) and not engine.scheduler.waiting
            t = time.perf_counter()
            engine.step()
            if decoding and len(engine.scheduler.running) == batch:
                times.append((time.perf_counter() - t) * 1e3)
        if not times:
            raise RuntimeError("no decode iteration ran with every row (rows finished early)")
        return statistics.median(times[1:] or times)
    finally:
        engine.stop()


def engine_overhead(loaded, batch: int, trials: int, steps: int = 16) -> dict:
    """The constraint's cost in the engine itself: the median engine iteration of ``batch`` greedy
    rows decoding under :data:`FREE_TEXT` against the same rows unconstrained (runs alternated,
    ``trials`` each; the median of each). Everything counts: masks (computed while the forward
    runs), the masked argmax, ``advance`` and the forced check, and the step that cannot be
    pipelined (a constrained row's next mask needs its token)."""
    free, con = [], []
    for _ in range(trials):
        free.append(engine_step_ms(loaded, batch, steps))
        con.append(engine_step_ms(loaded, batch, steps, constraint=FREE_TEXT))
    f, c = statistics.median(free), statistics.median(con)
    return {"engine_step_free_ms": f, "engine_step_constrained_ms": c, "engine_extra_pct": 100 * (c - f) / f}


def _advance_ms(loaded, batch: int, trials: int, steps: int = 8) -> float:
    """What the engine does per step for each constrained row after its token is read back:
    ``advance``, the ``forced`` check after it, and any forced span committed (engine/grammar_jump.py).

    The rows' tokens (random allowed ones) are recorded on one set of :func:`_states`, then
    replayed on fresh sets (``trials`` of them), timed: the median over sets of the time per step.
    """
    rng = np.random.default_rng(1)
    vocab = loaded.model.args.vocab_size
    record = _states(loaded, batch)
    plan: list[list[int | None]] = []  # per step, per row: the token it samples (None: finished)
    for _ in range(steps):
        step = []
        for st in record:
            if st.done:
                step.append(None)
                continue
            allowed = np.flatnonzero(np.unpackbits(st.bitmask().view(np.uint8), bitorder="little")[:vocab])
            tok = int(rng.choice(allowed))
            step.append(tok)
            st.advance(tok)
            while st.forced() and not st.done:
                for t in st.forced():
                    st.advance(t, forced=True)
        plan.append(step)
    times = []
    for _ in range(trials):
        states = _states(loaded, batch)
        t = time.perf_counter()
        for step in plan:
            for st, tok in zip(states, step):
                if tok is None:
                    continue
                st.advance(tok)
                forced = st.forced()
                while forced and not st.done:
                    for f in forced:
                        st.advance(f, forced=True)
                    forced = st.forced()
        times.append((time.perf_counter() - t) * 1e3 / steps)
    return statistics.median(times)


def overhead(loaded, trials: int) -> dict:
    """Per engine step at batch 1 and 32: the constraint's host and device work against the step.

    * ``mask_ms``: llguidance's masks for the batch (``fill_bitmasks``: its thread pool);
    * ``apply_ms``: the batch's mask applied on the device (``apply_bitmask``, one op);
    * ``sample_extra_ms``: what ``sample_rows`` (the engine's sampling of a step) takes more for
      greedy constrained rows than for the same rows greedy and unconstrained (one argmax): forced
      check, mask, apply and the masked argmax together, the logits already computed;
    * ``advance_ms``: each row's ``advance``, ``forced`` check and forced span after its token
      (see :func:`_advance_ms`);
    * ``overhead_pct``: ``sample_extra_ms + advance_ms`` against ``engine_step_ms``, one engine
      iteration of that many greedy rows decoding;
    * ``t1_*``: the same sampling at temperature 1 (each row its own seeded draw), for reference;
    * ``engine_*``: the engine's own iterations with and without a constraint (:func:`engine_overhead`).

    The mask is computed while the step's forward runs (the forward is queued first), so
    ``overhead_pct`` is an upper bound of what the constraint adds.
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

        def sample(rows) -> None:
            tokens, _ = sample_rows(rows, logits)
            mx.eval(tokens)

        timed = {}
        for temp, name in ((0.0, "greedy"), (1.0, "t1")):
            constrained, free = _rows(loaded, states, temp), _rows(loaded, [None] * batch, temp)
            sample(constrained), sample(free)
            timed[name] = (_median_ms(lambda: sample(constrained), trials * 10),
                           _median_ms(lambda: sample(free), trials * 10))
        advance_ms = _advance_ms(loaded, batch, trials * 4)
        step_ms = engine_step_ms(loaded, batch)
        in_engine = engine_overhead(loaded, batch, max(3, 2 * trials))
        (with_ms, without_ms), (t1_with, t1_without) = timed["greedy"], timed["t1"]
        extra, t1_extra = max(0.0, with_ms - without_ms), max(0.0, t1_with - t1_without)
        res = {"mask_ms": mask_ms, "apply_ms": apply_ms, "sample_constrained_ms": with_ms,
               "sample_unconstrained_ms": without_ms, "sample_extra_ms": extra, "advance_ms": advance_ms,
               "engine_step_ms": step_ms, "overhead_pct": 100 * (extra + advance_ms) / step_ms,
               "mask_plus_apply_pct": 100 * (mask_ms + apply_ms) / step_ms,
               "t1_sample_constrained_ms": t1_with, "t1_sample_unconstrained_ms": t1_without,
               "t1_sample_extra_ms": t1_extra, "t1_overhead_pct": 100 * (t1_extra + advance_ms) / (step_ms + t1_without),
               **in_engine}
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
