"""Served throughput and time to first token at 1 to 128 concurrent streams.

mlx-infer's continuous-batching engine (and, with ``--http``, ``mlx-infer serve``
in its own process, streamed over loopback) beside mlx-lm's
``BatchGenerator`` on the same model, in one process, engines alternating
trial by trial. ``mlx-infer`` detokenizes every token (as a server must);
``mlx-infer-ids`` hands out token ids only, as ``BatchGenerator`` does. Each
of S streams sends requests back to back (a closed loop: a stream's next
request starts when its last one ends) until ``--requests-per-stream`` x S
requests are done; every request has a prompt of ``-p`` tokens and generates
exactly ``-g`` tokens (EOS ignored, as ``mlx_lm.benchmark`` does).
End to end = generated tokens / wall time (prefill included); decode only =
tokens/s while the first S requests all decode together (from the last of
their first tokens to the first of their ends; no prefill in that window).

Each row also has the requests' TTFT p50/p95 (submit to first token, per
request, over every trial) and the peak memory: ``peak_gb`` is MLX's peak of this whole
process (every column's weights, our resident pool), ``own_peak_gb`` the column's own: its
weights + what it held resident when the trial began (our KV storage) + the trial's growth
above the process's active memory at its start (mlx-lm's cache, our pool's growth,
activations); the server's own from its /metrics for ``mlx-infer-http``. Our columns' trials and rows also
carry ``engine_ttft_mean_ms``, the engine's own mean time to first token over the trial's requests (its
``time_to_first_token_seconds`` histogram: submit to the engine -> first token read out), beside the client's
``ttft_mean_ms``: for the HTTP column the difference is the server's and the loopback's share, which its
``server_first_chunk_mean_ms`` (the server's ``http_time_to_first_chunk_seconds``: endpoint to first chunk)
splits again; and ``engine_itl_mean_ms``, the engine's mean inter-token latency (its
``inter_token_latency_seconds``): where two columns' engines decode alike, a gap between their tokens/s lies
outside the engine.

Warm-up: at every stream count each engine first runs one uncounted trial of the same
shape (compile/trace paths and buffers for that batch size); the rows are medians of the
``-n`` trials after it. Every trial (and warm-up) sends prompts of its own, so no trial is
helped by the prefix cache of an earlier one.

Memory (the row's ``gpu_sharing`` and ``kv_sizing`` say which applied): mlx-lm's model is
loaded first, then every in-process mlx-infer column's model, then their engines, so the
engine's default sizing (which subtracts what this process already holds) sees them all.
With one in-process mlx-infer column it gets that default; with several, each gets an equal
explicit share of it. ``--memory-budget`` overrides both. Unless ``--http-beside``, the HTTP column never
shares the GPU with an in-process pool: it runs in its own phase, after the in-process columns finish
and their engines and models are freed (``del``, ``gc.collect()``, ``mx.clear_cache()``),
so the server's default sizing sees the device empty; its ratios are against the mlx-lm
rows of the first phase. Each in-process row records its pool (``kv_pool_gb``,
``kv_pool_tokens``, ``kv_sizing``); the server's row records its startup line's pool. With
``--http-beside`` the server starts in the first phase instead (its weights in its own process), its
pool one more equal explicit share of the default, and its trials alternate with the in-process
columns' (the comparison the HTTP goal asks for: the machine's drift between phases is as large as it).

    python benchmarks/served.py --shape llama-1b --http --json benchmarks/results/h200-served-llama-1b.json \
        --plot benchmarks/results/h200-served-llama-1b.png        # on a GPU: the issue's table
    python benchmarks/served.py --shape llama-1b --toy --streams 1,8 -p 32 -g 16 --http   # CPU smoke run
    python benchmarks/served.py --tiny llama --streams 1,8,32 -p 32 -g 64 --json R.json
    python benchmarks/served.py --streams 1,8,32 -p 16 -g 8 -r 1 -n 1 --json R.json   # real Gemma 3 270M

``--shape NAME`` builds random bf16 weights of a real model shape (the
shapes of ``gpu_decode.py``; ``--toy`` shrinks them for a CPU run) and saves
them as a model directory both engines load, with a word-level tokenizer over
the whole vocabulary (token ``i`` is the word ``t{i}``), so the engine
detokenizes every id it samples.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from _common import environment  # switches set around a column's engine
from served_http import OursHTTP, OursHTTPThread, describe  # the HTTP column (its own module: client processes)
from served_models import model_dir, prompts_for  # the model directory and the prompts
from served_report import markdown, percentile, plot  # the table, the TTFT percentiles, the PNG

ROOT = Path(__file__).resolve().parent.parent
KERNELS: dict[str, Any] = {}  # load_model options (--stock-kernels)
BUDGET_GB: float | None = None  # --memory-budget for both mlx-infer columns (None: sized from the device)


class Ours:
    """mlx-infer's engine, in process."""

    name = "mlx-infer"

    policy: dict[str, Any] = {}  # PagedDecodePolicy fields of this column (default: the engine's)
    config: dict[str, Any] = {}  # EngineConfig fields of this column (default: the engine's)

    def __init__(self, path: Path, max_batch: int):
        from mlx_infer.artifacts.loader import load_model

        self.loaded = load_model(path, **KERNELS)
        # Materialize the lazy arrays here (weights, and non-parameter ones such as llama3 RoPE's
        # _freqs): their ops belong to this thread's stream, which the engine thread cannot
        # evaluate ("There is no Stream(gpu, 0) in current thread").
        model = self.loaded.model
        mx.eval(model.parameters(), [v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])
        self.max_batch = max_batch
        self.detokenize = True
        self.engine: Any = None

    def start(self, budget_gb: float | None, sizing: str) -> None:
        """Build the engine (after every model of the process is loaded): ``budget_gb`` as
        ``--memory-budget`` (``None``: the device default); ``sizing`` says which, for the rows."""
        from mlx_infer.engine import Engine, EngineConfig
        from mlx_infer.generation.bindings.paged_decode_step import PagedDecodePolicy

        self.engine = Engine(self.loaded, EngineConfig(max_batch=self.max_batch, memory_budget_gb=budget_gb,
                                                         **self.config),
                             decode_policy=PagedDecodePolicy(**self.policy)).start()
        self.sizing = sizing
        store = self.engine.store
        budget = self.engine.kv_budget
        print(f"{self.name}: compiled paged step {self.engine.paged_decode is not None} "
              f"({self.engine.paged_decode_reason or PagedDecodePolicy(**self.policy)}); KV pool "
              f"{(store.groups[0].num_pages - 1) * store.page_size:,} tokens ({sizing}: "
              f"{f'{budget.bytes / 2**30:.2f} GiB from {budget.source}' if budget else 'num_pages'})", file=sys.stderr)

    def run(self, streams: int, prompts: list[list[int]], gen: int) -> int:
        from mlx_infer.engine import EngineRequest

        todo = list(prompts)
        lock = threading.Lock()
        total = [0, 0]  # tokens, finished requests
        done = threading.Event()
        self.events: list[tuple[float, str, bool]] = []
        self.ttfts: list[float] = []
        sent: dict[str, float] = {}

        def submit() -> None:  # called under lock
            p = todo.pop(0)
            req = EngineRequest(prompt_ids=p, max_tokens=gen, ignore_eos=True, detokenize=self.detokenize)
            sent[req.request_id] = time.perf_counter()
            self.engine.submit(req, on_token=on_token)

        def on_token(ev: Any) -> None:  # on the engine thread: a stream's next request starts as one ends
            with lock:
                now = time.perf_counter()
                if ev.index == 0 and ev.token is not None:
                    self.ttfts.append(now - sent[ev.request_id])
                self.events.append((now, ev.request_id, ev.finish_reason is not None))
                total[0] += ev.token is not None
                if ev.finish_reason is not None:
                    total[1] += 1
                    if todo:
                        submit()
                    elif total[1] == len(prompts):
                        done.set()

        with lock:
            for _ in range(min(streams, len(todo))):
                submit()
        done.wait()
        step = self.engine.paged_decode
        if step is not None:
            print(f"{self.name}: paged step traces {step.traces}, steps {step.native.steps}, "
                  f"eager steps {step.eager_steps}, attention on {step.attention_backend!r}", file=sys.stderr)
        return total[0]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.engine = self.loaded = None


class OursIds(Ours):
    """The engine handing out token ids only (no detokenizer): what ``BatchGenerator`` returns."""

    name = "mlx-infer-ids"

    def __init__(self, path: Path, max_batch: int):
        super().__init__(path, max_batch)
        self.detokenize = False


class OursIdsGather(OursIds):
    """Token ids, the compiled paged step on its gather path (the reference the kernel replaces)."""

    name = "mlx-infer-ids-gather"
    policy = {"attention": "gather"}


class OursIdsUnbounded(OursIds):
    """Token ids, each iteration's activations not held to the engine's reserve (the A/B of
    ``EngineConfig.bound_activations``, engine/activations.py)."""

    name = "mlx-infer-ids-unbounded"
    config = {"bound_activations": False}


class _EnvColumn(OursIds):
    """Token ids with ``env`` set while the column's engine is built and while it runs (the knobs the C++
    side reads at each trace or call, and those the engine reads when it is built)."""

    env: dict[str, str] = {}

    def start(self, budget_gb: float | None, sizing: str) -> None:
        with self._env():
            super().start(budget_gb, sizing)

    def run(self, streams: int, prompts: list[list[int]], gen: int) -> int:
        with self._env():
            return super().run(streams, prompts, gen)

    def _env(self) -> contextlib.AbstractContextManager[None]:
        return environment(self.env)


def env_column(spec: str, name: str | None = None) -> type:
    """A token-ids column with ``spec`` (``VAR=V[,VAR2=W]``) set while its engine is built and runs
    (``--env-column``): the A/B of switches read at each trace or when an engine is built, beside the
    default column in the same run. ``name``: the column's (default ``mlx-infer-ids[spec]``)."""
    pairs = [item.split("=", 1) for item in spec.split(",")]
    if not all(len(p) == 2 and p[0] for p in pairs):
        raise SystemExit(f"--env-column takes VAR=VALUE[,VAR2=VALUE2], got {spec!r}")
    return type("OursIdsEnv", (_EnvColumn,), {"name": name or f"mlx-infer-ids[{spec}]", "env": dict(pairs)})


#: The decode graphs' dense CUDA products all through MLX's matmul (their traces take MLX's products): the A/B of
#: the GEMV kernel (cpp/matmul).
OursIdsNoGemv = env_column("MLX_INFER_GEMV_ROWS=0", "mlx-infer-ids-nogemv")
#: The step plan not prefetched to the GPU (its first kernel faults the managed pages in): the A/B of
#: ``_fast.prefetch_to_gpu`` (cpp/kv/prefetch.cpp).
OursIdsNoPrefetch = env_column("MLX_INFER_PREFETCH_PLAN=0", "mlx-infer-ids-noprefetch")


class MlxLm:
    """mlx-lm's ``BatchGenerator`` (continuous batching), refilled as requests finish."""

    name = "mlx-lm"

    def __init__(self, path: Path, max_batch: int):
        from mlx_lm.utils import load_model

        self.model = load_model(path)[0]

    def run(self, streams: int, prompts: list[list[int]], gen: int) -> int:
        from mlx_lm.generate import BatchGenerator

        g = BatchGenerator(self.model, max_tokens=gen, completion_batch_size=streams,
                           prefill_batch_size=min(streams, 8), prefill_step_size=512)
        todo = list(prompts)
        sent: dict[Any, float] = {}
        self.ttfts = []

        def insert(batch: list[list[int]]) -> None:
            now = time.perf_counter()
            for uid in g.insert(batch, [gen] * len(batch)):
                sent[uid] = now

        insert([todo.pop(0) for _ in range(min(streams, len(todo)))])
        total = 0
        self.events = []
        while True:
            responses = g.next_generated()
            if not responses:
                break
            now = time.perf_counter()
            for r in responses:
                if r.uid in sent:
                    self.ttfts.append(now - sent.pop(r.uid))
            self.events += [(now, r.uid, r.finish_reason is not None) for r in responses]
            total += len(responses)
            done = sum(1 for r in responses if r.finish_reason is not None)
            if done and todo:
                insert([todo.pop(0) for _ in range(min(done, len(todo)))])
        g.close()
        return total

    def close(self) -> None:
        self.model = None


class MlxLmStep(MlxLm):
    """mlx-lm's ``generate_step``, one request after another: issue 16's 1-stream anchor (a column of the
    1-stream rows only; ``--mlx-lm-step``)."""

    name = "mlx-lm-step"
    max_streams = 1

    def run(self, streams: int, prompts: list[list[int]], gen: int) -> int:
        from mlx_lm.generate import generate_step

        total = 0
        self.ttfts, self.events = [], []
        for uid, prompt in enumerate(prompts):
            sent = time.perf_counter()
            for n, (token, _) in enumerate(generate_step(mx.array(prompt, mx.uint32), self.model, max_tokens=gen)):
                now = time.perf_counter()
                if n == 0:
                    self.ttfts.append(now - sent)
                self.events.append((now, uid, n == gen - 1))
                total += 1
        return total


def decode_window(events: list[tuple], streams: int) -> float | None:
    """Tokens/s while all of the first ``streams`` requests decode together: from the last of
    their first tokens to the first of their ends (no prefill inside the window). An event is
    ``(time, request, finished)`` (one token) or ``(time, request, finished, tokens)`` (an HTTP
    chunk carrying several)."""
    first: dict[Any, float] = {}
    end: dict[Any, float] = {}
    for t, rid, fin, *_ in events:
        first.setdefault(rid, t)
        if fin:
            end.setdefault(rid, t)
    wave = list(first)[:streams]
    if len(wave) < streams or any(r not in end for r in wave):
        return None
    lo, hi = max(first[r] for r in wave), min(end[r] for r in wave)
    n = sum(e[3] if len(e) > 3 else 1 for e in events if lo < e[0] <= hi)
    return n / (hi - lo) if hi > lo and n else None


def timed(run: Callable[[], int]) -> tuple[float, int, float, float]:
    """(wall s, tokens, process peak GB, peak GB above the active memory at the start)."""
    mx.clear_cache()  # the last trial's freed buffers (another engine's, maybe) are not this one's peak
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    t = time.perf_counter()
    n = run()
    peak = mx.get_peak_memory()
    return time.perf_counter() - t, n, peak / 1e9, (peak - start) / 1e9


def engine_histogram(e: Any, name: str) -> tuple[float, int] | None:
    """(sum of seconds, count) of one of our engine's own latency histograms, in process or from the server's
    /metrics: ``time_to_first_token`` (submit to the engine -> first token read out) or ``inter_token_latency``
    (between a sequence's consecutive tokens read out of the steps); None for mlx-lm's columns."""
    if isinstance(e, OursHTTP):
        return e.histogram(name + "_seconds")
    engine = getattr(e, "engine", None) if isinstance(e, Ours) else None
    if engine is None:
        return None
    h = getattr(engine.metrics, name)
    return h.sum, h.count


def mean_ms(before: tuple[float, int] | None, after: tuple[float, int] | None) -> float | None:
    """The mean (ms) of a histogram's observations between two (sum, count) readings; None where none."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1e3


def own_resident_gb(e: Any) -> float:
    """GB a column holds between trials: its weights, and our engine's allocated KV storage."""
    from mlx_infer.engine.config import weight_bytes

    if isinstance(e, Ours) and getattr(e, "engine", None) is not None:
        return (weight_bytes(e.loaded.model) + e.engine.store.nbytes) / 1e9
    if isinstance(e, MlxLm) and e.model is not None:
        return weight_bytes(e.model) / 1e9
    return 0.0  # the HTTP column: its server reports its own peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded Gemma 3 270M)")
    p.add_argument("--tiny", choices=["llama", "gemma3"], default=None, help="a random tiny model instead")
    p.add_argument("--shape", default=None, help="random bf16 weights of this real shape (gpu_decode.py's SHAPES)")
    p.add_argument("--toy", action="store_true", help="with --shape: the shape's toy sizes (a CPU run)")
    p.add_argument("--quantize", type=int, choices=(4, 8), help="with --shape: the weights affine-quantized, group 64")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="mlx-infer's --memory-budget (default: its pool is sized from the device)")
    p.add_argument("--streams", default="1,8,32,64,128", help="concurrent streams (comma list)")
    p.add_argument("--prompt-tokens", "-p", type=int, default=32)
    p.add_argument("--generation-tokens", "-g", type=int, default=64)
    p.add_argument("--requests-per-stream", "-r", type=int, default=2)
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--http", action="store_true", help="also run mlx-infer behind the HTTP server")
    p.add_argument("--http-beside", action="store_true",
                   help="with --http: the server runs beside the in-process columns (one phase, trials alternating; "
                        "every pool an equal explicit share of the default sizing) instead of in its own phase")
    p.add_argument("--mlx-lm-step", action="store_true",
                   help="also mlx-lm's generate_step (one request at a time) in the 1-stream rows: issue 16's "
                        "1-stream anchor")
    p.add_argument("--http-thread", action="store_true",
                   help="with --http --http-beside: also the server with its engine as a thread of its own process "
                        "(--no-engine-process), the A/B of the engine process")
    p.add_argument("--http-pyspy", default=None, metavar="PATH",
                   help="with --http: sample the server's GIL holder with py-spy during its first trial of 16+ streams "
                        "(collapsed stacks to PATH)")
    p.add_argument("--http-clients", type=int, default=None, metavar="N",
                   help="client processes of the HTTP column (default: one per 16 streams of the largest count; "
                        "served_http.py)")
    p.add_argument("--env-column", action="append", default=[], metavar="VAR=V[,VAR2=W]",
                   help="one more token-ids column with these environment variables set while it runs "
                        "(switches read at each trace); repeatable")
    p.add_argument("--no-ids", action="store_true", help="skip the token-ids-only mlx-infer column")
    p.add_argument("--gather", action="store_true",
                   help="add a token-ids column whose paged step gathers K/V (attention='gather')")
    p.add_argument("--unbounded", action="store_true",
                   help="add a token-ids column whose iterations' activations are not bounded (bound_activations=False)")
    p.add_argument("--no-gemv", action="store_true",
                   help="also a token-ids column with MLX's products instead of the GEMV kernel (CUDA A/B)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="also a token-ids column whose step plan is not prefetched to the GPU (CUDA A/B)")
    p.add_argument("--no-text", action="store_true",
                   help="skip the detokenizing mlx-infer column (random-weight models: --shape)")
    p.add_argument("--stock-kernels", action="store_true",
                   help="load mlx-infer's model on MLX's stock kernels (as mlx-lm runs): the engine alone compared")
    p.add_argument("--json", default=None, help="write the results document here")
    p.add_argument("--plot", default=None, help="write a PNG of tokens/s and TTFT p50/p95 over streams here")
    args = p.parse_args()
    global BUDGET_GB
    BUDGET_GB = args.memory_budget

    from mlx_infer.bench.report import results_document, write_json

    import inspect

    from mlx_infer.artifacts.loader import load_model

    if args.stock_kernels and "cpu_kernels" in inspect.signature(load_model).parameters:
        KERNELS["cpu_kernels"] = False
    kernels = "stock" if args.stock_kernels else "default"
    path = model_dir(args)
    streams = [int(s) for s in args.streams.split(",")]
    ours_kinds: list[type] = (([] if args.no_text else [Ours]) + ([] if args.no_ids else [OursIds])
                              + ([OursIdsGather] if args.gather else [])
                                  + ([OursIdsUnbounded] if args.unbounded else [])
                              + ([OursIdsNoGemv] if args.no_gemv else [])
                              + ([OursIdsNoPrefetch] if args.no_prefetch else [])
                              + [env_column(spec) for spec in args.env_column])
    vocab = int(json.loads((path / "config.json").read_text()).get("vocab_size", 320))
    max_batch = max(streams)
    by_streams: dict[int, list[dict[str, Any]]] = {s: [] for s in streams}
    columns: list[Any] = []
    try:
        # Phase 1, in process: mlx-lm's model first, then ours, then our engines (module docstring).
        base = MlxLm(path, max_batch)
        ours = [k(path, max_batch) for k in ours_kinds]
        columns = ours + [base]
        if args.mlx_lm_step and 1 in streams:  # its model is mlx-lm's (one copy)
            step = MlxLmStep.__new__(MlxLmStep)
            step.model = base.model
            columns.append(step)
        beside = args.http and args.http_beside
        servers = [OursHTTP] + ([OursHTTPThread] if args.http_thread else [])
        sizing, sharing, budget = start_engines(ours, max_batch, beside=len(servers) if beside else 0)
        if beside:  # the servers share the phase: each one's pool is one more equal share
            for k in reversed(servers):
                columns.insert(len(ours), k(path, max_batch, budget, args.http_clients, args.http_pyspy))
            sharing += "; mlx-infer serve in its own process beside them, alternating too"
        for i, s in enumerate(streams):
            for r in measure(columns, s, args, vocab):
                r.update(kernels=kernels, gpu_sharing=sharing)
                if r["engine"] != "mlx-lm":
                    r["kv_sizing"] = sizing
                server = next((c for c in columns if isinstance(c, OursHTTP) and c.name == r["engine"]), None)
                if server is not None:
                    r.update(kv_pool=server.pool, **describe(server))
                by_streams[s].append(r)
            if args.json:  # what has finished survives a run cut short (a device call's time limit)
                write_json(results_document(finish(by_streams, streams[: i + 1], args, path)), Path(args.json))
        for c in columns:
            c.close()
        del base, ours, c
        columns = []
        gc.collect()
        mx.clear_cache()
        if args.http and not args.http_beside:  # Phase 2: the server alone on the device
            columns = [OursHTTP(path, max_batch, BUDGET_GB, args.http_clients, args.http_pyspy)]
            for s in streams:
                for r in measure(columns, s, args, vocab):
                    r.update(kernels=kernels, kv_sizing=columns[0].sizing, kv_pool=columns[0].pool,
                             gpu_sharing="own phase: no in-process engine or model is loaded while it runs",
                             **describe(columns[0]))
                    by_streams[s].append(r)
    finally:
        for c in columns:
            c.close()
    rows = finish(by_streams, streams, args, path)
    doc = results_document(rows)
    print(markdown(rows))
    if args.json:
        write_json(doc, Path(args.json))
    if args.plot:
        plot(doc, Path(args.plot))


def finish(by_streams: dict[int, list[dict[str, Any]]], streams: list[int], args: argparse.Namespace,
           path: Path) -> list[dict[str, Any]]:
    """The rows of ``streams``, each with its ratios against mlx-lm's row of the same stream count."""
    for s in streams:
        group = by_streams[s]
        ref = next(r for r in group if r["engine"] == "mlx-lm")
        for r in group:
            r["model"] = args.tiny and f"tiny-{args.tiny}" or path.name
            r["ratio_vs_mlx-lm"] = r["decode_tps"] / ref["decode_tps"]
            r["decode_only_ratio_vs_mlx-lm"] = (r["decode_only_tps"] / ref["decode_only_tps"]
                                                if r["decode_only_tps"] and ref["decode_only_tps"] else None)
    return [r for s in streams for r in by_streams[s]]


def start_engines(ours: list[Ours], max_batch: int, beside: int = 0) -> tuple[str, str, float | None]:
    """Build the in-process engines once every model is loaded: ``(their sizing, how they share
    the device, the budget each got)`` (module docstring). ``beside``: HTTP servers that will share
    the device too, each one more pool in the split."""
    pools = len(ours) + beside
    if BUDGET_GB is not None:
        budget, sizing = BUDGET_GB, f"--memory-budget {BUDGET_GB:g} each"
    elif pools <= 1:
        budget, sizing = None, "default device sizing, after mlx-lm's model was loaded"
    else:
        from mlx_infer.engine import EngineConfig
        from mlx_infer.engine.config import KV_FRACTION, kv_budget

        whole = kv_budget(ours[0].loaded.model, EngineConfig(max_batch=max_batch))
        budget = whole.bytes / pools / KV_FRACTION / 2**30  # so each pool gets 1/n of the default's KV bytes
        sizing = f"1/{pools} of the default device sizing each ({whole.bytes / 2**30:.2f} GiB: {whole.source})"
    for e in ours:
        e.start(budget, sizing)
    sharing = (f"in process: {len(ours)} mlx-infer engine(s) and mlx-lm's model, loaded before the engines; "
               "engines alternate trial by trial")
    return sizing, sharing, budget


def measure(engines: list[Any], s: int, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """One uncounted warm-up trial per engine at ``s`` streams, then ``-n`` trials alternating
    engines; a row per engine (medians over the counted trials). Each trial has prompts of its own."""
    n = s * args.requests_per_stream
    engines = [e for e in engines if s <= getattr(e, "max_streams", s)]  # mlx-lm-step: 1-stream rows only
    for e in engines:
        e.run(s, prompts_for(n, args.prompt_tokens, vocab), args.generation_tokens)
    trials: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
    for i in range(args.num_trials):
        prompts = prompts_for(n, args.prompt_tokens, vocab, start=(i + 1) * n)
        for e in engines:
            resident = own_resident_gb(e)
            before = engine_histogram(e, "time_to_first_token")
            gaps_before = engine_histogram(e, "inter_token_latency")
            chunk_before = e.histogram("http_time_to_first_chunk_seconds") if isinstance(e, OursHTTP) else None
            wall, tokens, peak, growth = timed(lambda: e.run(s, prompts, args.generation_tokens))
            own = resident + growth
            if isinstance(e, OursHTTP):
                peak = own = e.peak_gb()
            # the engine's own mean TTFT over this trial's requests, beside the client's (the difference: the
            # HTTP server's and the loopback's share for the server column, the callback's for in-process), and
            # the server's own to its first chunk (the HTTP column)
            inside = mean_ms(before, engine_histogram(e, "time_to_first_token"))
            # the engine's mean inter-token latency: equal in two columns, their engines decoded as fast (a gap
            # between their tokens/s is then outside the engine: the server, the loopback, the clients)
            itl = mean_ms(gaps_before, engine_histogram(e, "inter_token_latency"))
            server = mean_ms(chunk_before, e.histogram("http_time_to_first_chunk_seconds")) if chunk_before else None
            window = decode_window(getattr(e, "events", []), s)
            client = statistics.fmean(e.ttfts) * 1e3 if e.ttfts else None
            trials[e.name].append({"tps": tokens / wall, "decode_only_tps": window, "wall_s": wall,
                                   "tokens": tokens, "peak_gb": peak, "own_peak_gb": own,
                                   "ttft_s": list(e.ttfts), "ttft_mean_ms": client, "engine_ttft_mean_ms": inside,
                                   "engine_itl_mean_ms": itl,
                                   **({"server_first_chunk_mean_ms": server} if isinstance(e, OursHTTP) else {})})
            print(f"streams {s:>3} {e.name:>15}: {tokens / wall:9.1f} tok/s end to end, decode only "
                  f"{window or 0:9.1f} tok/s ({tokens} tokens, {wall:.2f} s), TTFT mean {client or 0:.1f} ms"
                  + (f" (in the engine {inside:.1f})" if inside is not None else "")
                  + (f", engine inter-token {itl:.2f} ms" if itl is not None else "")
                  + (f" (to the server's first chunk {server:.1f})" if server is not None else ""), file=sys.stderr)
    rows = []
    for e in engines:
        t = trials[e.name]
        ttft = sorted(x for tr in t for x in tr["ttft_s"])
        p50, p95 = percentile(ttft, 50) * 1e3, percentile(ttft, 95) * 1e3
        rows.append({"suite": "served", "engine": e.name, "batch": s, "prompt_tokens": args.prompt_tokens,
                     "generation_tokens": args.generation_tokens, "prompt_tps": 0.0, "ttft_ms": p50,
                     "ttft_p50_ms": p50, "ttft_p95_ms": p95, "warmup_trials": 1,
                     "decode_tps": statistics.median(x["tps"] for x in t),
                     "decode_only_tps": (statistics.median(x["decode_only_tps"] for x in t)
                                         if all(x["decode_only_tps"] for x in t) else None),
                     "peak_gb": max((x["peak_gb"] for x in t if x["peak_gb"] is not None), default=None),
                     "own_peak_gb": max((x["own_peak_gb"] for x in t if x["own_peak_gb"] is not None),
                                        default=None),
                     **{k: (statistics.median(x[k] for x in t) if all(x[k] is not None for x in t) else None)
                        for k in ("engine_ttft_mean_ms", "engine_itl_mean_ms")},
                     **memory_of(e), "trials": t})
    return rows


def memory_of(e: Any) -> dict[str, float]:
    """For an in-process mlx-infer column: its weights and its KV pool (allocated storage), GB, so
    ``peak_gb`` can be checked against weights + pool + activations (pages written in place).
    ``peak_gb`` itself is the whole process's: every column's weights are loaded in it."""
    if not isinstance(e, Ours):
        return {}
    from mlx_infer.engine.config import weight_bytes

    store = e.engine.store
    return {"weights_gb": weight_bytes(e.loaded.model) / 1e9, "kv_pool_gb": store.nbytes / 1e9,
            "kv_pool_tokens": (store.groups[0].num_pages - 1) * store.page_size}


if __name__ == "__main__":
    main()
