"""Run under ``mlx.launch`` (or alone) by tests/test_distributed*.py: one model, every path, one JSON line per rank.

Usage: ``python tests/dist_worker.py MODEL_DIR MODE [MAX_TOKENS]`` (MODEL_DIR: one directory, or several
joined by ``os.pathsep``, run one after another in the same processes, one result each); MODE is ``generate``
(eager and compiled ``generate``), ``engine`` (several concurrent requests through the
engine, compiled paged step on and off; ``engine-compiled``: on only), ``sampled`` (seeded sampling with penalties and
logprobs through the engine) or ``die`` (rank 1 exits mid-generation).
Prints ``RESULT {...}`` on each rank.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

PROMPTS = ["The capital of France is", "Hello world! This", "def f(x):", "Numbers 0123 and"]


def main() -> None:
    warnings.simplefilter("error", RuntimeWarning)  # a compiled step that falls back is a failure here
    mode = sys.argv[2]
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    for model_dir in sys.argv[1].split(os.pathsep):
        run_one(model_dir, mode, max_tokens)


def run_one(model_dir: str, mode: str, max_tokens: int) -> None:
    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.parallel import current_group

    pg = current_group()
    loaded = load_model(model_dir)
    out: dict = {"rank": pg.rank, "size": pg.size, "backend": pg.backend, "weight_bytes": loaded.weight_bytes,
                 "model": model_dir,
                 "replicated_bytes": getattr(getattr(loaded.model, "tensor_parallel", None), "replicated_bytes", 0)}
    if mode == "generate":
        from mlx_infer.generation.autoregressive import generate

        for compiled in (False, True):
            out[f"compiled={compiled}"] = [t.token for t in generate(loaded, PROMPTS[0], max_tokens=max_tokens,
                                                                     compiled=compiled)]
    elif mode == "sampled":  # seeded sampling, penalties, logprobs; and one request left to a server-chosen seed
        from mlx_infer.engine import Engine, EngineConfig
        from mlx_infer.engine.request import EngineRequest
        from mlx_infer.parallel.engine_rank import follow
        from mlx_infer.sampling import SamplingParams

        ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
        engine = Engine(loaded, EngineConfig(max_batch=4, num_pages=64, page_size=8))
        if pg.rank != 0:
            follow(engine)
            out["sampled"] = "follower"
        else:
            reqs = [EngineRequest(prompt_ids=i, max_tokens=max_tokens, request_id=f"s{k}", ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.8, top_k=50, repetition_penalty=1.3,
                                                          seed=None if k == 3 else 100 + k, logprobs=True))
                    for k, i in enumerate(ids)]
            with engine:
                results = engine.generate(reqs, timeout=60)
            out["sampled"] = [[r.token_ids, r.finish_reason, [round(x, 3) for x in r.logprobs or []]]
                              for r in results]
    elif mode in ("engine", "engine-compiled", "die"):
        from mlx_infer.engine import Engine, EngineConfig
        from mlx_infer.engine.request import EngineRequest
        from mlx_infer.generation.bindings.autoregressive import Composition
        from mlx_infer.parallel.engine_rank import follow

        ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
        for compiled in ((True, False) if mode == "engine" else (True,)):  # engine-compiled, die: the compiled step
            engine = Engine(loaded, EngineConfig(max_batch=4, num_pages=64, page_size=8),
                            composition=Composition(compiled_decode=compiled))
            if pg.rank != 0:
                if mode == "die":
                    import threading

                    threading.Timer(1.0, lambda: os._exit(9)).start()
                follow(engine)
                out[f"compiled={compiled}"] = "follower"
                continue
            reqs = [EngineRequest(prompt_ids=i, max_tokens=max_tokens + k, request_id=f"r{k}",
                                  ignore_eos=True) for k, i in enumerate(ids)]
            if mode == "die":
                reqs = [EngineRequest(prompt_ids=ids[0], max_tokens=10_000, request_id="long", ignore_eos=True)]
            with engine:
                results = engine.generate(reqs, timeout=60)
                out[f"compiled={compiled}"] = [[r.token_ids, r.finish_reason, r.error] for r in results]
                if mode == "die":  # the engine ends this process after its grace period
                    result_line(out)
            out[f"paged_decode={compiled}"] = engine.paged_decode is not None
    result_line(out)


def result_line(out: dict) -> None:
    """``RESULT {...}`` and its newline in one write: the ranks share the launcher's stdout, and print's
    separate writes of the text and the newline (unbuffered output) interleaved two ranks' lines once."""
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
