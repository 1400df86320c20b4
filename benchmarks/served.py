"""Served throughput: aggregate decode tokens/s at 1, 8 and 32 concurrent streams.

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

    python benchmarks/served.py --tiny llama --streams 1,8,32 -p 32 -g 64 --json R.json
    python benchmarks/served.py --streams 1,8,32 -p 16 -g 8 -r 1 -n 1 --json R.json   # real Gemma 3 270M
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
KERNELS: dict[str, Any] = {}  # load_model options (--stock-kernels)


def model_dir(args: argparse.Namespace) -> Path:
    """The MLX directory to benchmark: a fresh tiny model, the given path, or the embedded model."""
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import make_tiny_model_dir

        return make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="served-")) / args.tiny, args.tiny)
    from mlx_infer.artifacts.default_model import default_model_gguf
    from mlx_infer.artifacts.loader import converted_gguf_dir, is_gguf

    source = Path(args.model).expanduser() if args.model else default_model_gguf()
    return converted_gguf_dir(source) if is_gguf(source) else source


def prompts_for(n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` ids (no shared prefix page, so no prefix-cache help)."""
    return [[(97 * i + 31 * j + 7) % (vocab - 10) + 5 for j in range(length)] for i in range(n)]


class Ours:
    """mlx-infer's engine, in process."""

    name = "mlx-infer"

    policy: dict[str, Any] = {}  # PagedDecodePolicy fields of this column (default: the engine's)

    def __init__(self, path: Path, max_batch: int):
        from mlx_infer.artifacts.loader import load_model
        from mlx_infer.engine import Engine, EngineConfig
        from mlx_infer.generation.bindings.paged_decode_step import PagedDecodePolicy

        self.loaded = load_model(path, **KERNELS)
        # Materialize the lazy arrays here (weights, and non-parameter ones such as llama3 RoPE's
        # _freqs): their ops belong to this thread's stream, which the engine thread cannot
        # evaluate ("There is no Stream(gpu, 0) in current thread").
        model = self.loaded.model
        mx.eval(model.parameters(), [v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])
        self.engine = Engine(self.loaded, EngineConfig(max_batch=max_batch),
                             decode_policy=PagedDecodePolicy(**self.policy)).start()
        print(f"{self.name}: compiled paged step {self.engine.paged_decode is not None} "
              f"({self.engine.paged_decode_reason or PagedDecodePolicy(**self.policy)})", file=sys.stderr)
        self.detokenize = True

    def run(self, streams: int, prompts: list[list[int]], gen: int) -> int:
        from mlx_infer.engine import EngineRequest

        todo = list(prompts)
        lock = threading.Lock()
        total = [0, 0]  # tokens, finished requests
        done = threading.Event()
        self.events: list[tuple[float, str, bool]] = []

        def submit() -> None:  # called under lock
            p = todo.pop(0)
            req = EngineRequest(prompt_ids=p, max_tokens=gen, ignore_eos=True, detokenize=self.detokenize)
            self.engine.submit(req, on_token=on_token)

        def on_token(ev: Any) -> None:  # on the engine thread: a stream's next request starts as one ends
            with lock:
                self.events.append((time.perf_counter(), ev.request_id, ev.finish_reason is not None))
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
        self.engine.stop()


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


class OursHTTP:
    """``mlx-infer serve`` in its own process; clients stream completions over loopback."""

    name = "mlx-infer-http"

    def __init__(self, path: Path, max_batch: int):
        import socket
        import subprocess

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_infer", "serve", "--model", str(path),
                                      "--port", str(port), "--max-batch", str(max_batch), "--log-level", "warning"])
        self.model = path.name
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("mlx-infer serve did not start")

    def run(self, streams: int, prompts: list[list[int]], gen: int) -> int:
        import httpx

        async def main() -> int:
            queue = list(prompts)
            total = 0
            limits = httpx.Limits(max_connections=streams + 4)
            async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as client:
                async def stream() -> None:
                    nonlocal total
                    while queue:
                        body = {"model": self.model, "prompt": queue.pop(0), "max_tokens": gen, "stream": True,
                                "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
                        async with client.stream("POST", "/v1/completions", json=body) as resp:
                            async for line in resp.aiter_lines():
                                if line.startswith("data: {"):
                                    usage = json.loads(line[6:]).get("usage")
                                    total += usage["completion_tokens"] if usage else 0
                await asyncio.gather(*(stream() for _ in range(streams)))
            return total
        return asyncio.run(main())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


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
        g.insert([todo.pop(0) for _ in range(min(streams, len(todo)))], [gen] * min(streams, len(prompts)))
        total = 0
        self.events = []
        while True:
            responses = g.next_generated()
            if not responses:
                break
            now = time.perf_counter()
            self.events += [(now, r.uid, r.finish_reason is not None) for r in responses]
            total += len(responses)
            done = sum(1 for r in responses if r.finish_reason is not None)
            if done and todo:
                batch = [todo.pop(0) for _ in range(min(done, len(todo)))]
                g.insert(batch, [gen] * len(batch))
        g.close()
        return total

    def close(self) -> None:
        del self.model


def decode_window(events: list[tuple[float, Any, bool]], streams: int) -> float | None:
    """Tokens/s while all of the first ``streams`` requests decode together: from the last of
    their first tokens to the first of their ends (no prefill inside the window)."""
    first: dict[Any, float] = {}
    end: dict[Any, float] = {}
    for t, rid, fin in events:
        first.setdefault(rid, t)
        if fin:
            end.setdefault(rid, t)
    wave = list(first)[:streams]
    if len(wave) < streams or any(r not in end for r in wave):
        return None
    lo, hi = max(first[r] for r in wave), min(end[r] for r in wave)
    n = sum(1 for t, rid, _ in events if lo < t <= hi)
    return n / (hi - lo) if hi > lo and n else None


def timed(run: Callable[[], int]) -> tuple[float, int, float]:
    mx.reset_peak_memory()
    t = time.perf_counter()
    n = run()
    return time.perf_counter() - t, n, mx.get_peak_memory() / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded Gemma 3 270M)")
    p.add_argument("--tiny", choices=["llama", "gemma3"], default=None, help="a random tiny model instead")
    p.add_argument("--streams", default="1,8,32", help="concurrent streams (comma list)")
    p.add_argument("--prompt-tokens", "-p", type=int, default=32)
    p.add_argument("--generation-tokens", "-g", type=int, default=64)
    p.add_argument("--requests-per-stream", "-r", type=int, default=2)
    p.add_argument("--num-trials", "-n", type=int, default=3)
    p.add_argument("--http", action="store_true", help="also run mlx-infer behind the HTTP server")
    p.add_argument("--no-ids", action="store_true", help="skip the token-ids-only mlx-infer column")
    p.add_argument("--gather", action="store_true",
                   help="add a token-ids column whose paged step gathers K/V (attention='gather')")
    p.add_argument("--no-text", action="store_true",
                   help="skip the detokenizing mlx-infer column (random-weight models: benchmarks/gpu_served.py)")
    p.add_argument("--stock-kernels", action="store_true",
                   help="load mlx-infer's model on MLX's stock kernels (as mlx-lm runs): the engine alone compared")
    p.add_argument("--json", default=None, help="write the results document here")
    args = p.parse_args()

    from mlx_infer.bench.report import results_document, write_json

    import inspect

    from mlx_infer.artifacts.loader import load_model

    if args.stock_kernels and "cpu_kernels" in inspect.signature(load_model).parameters:
        KERNELS["cpu_kernels"] = False
    kernels = "stock" if args.stock_kernels else "default"
    path = model_dir(args)
    streams = [int(s) for s in args.streams.split(",")]
    kinds: list[type] = (([] if args.no_text else [Ours]) + ([] if args.no_ids else [OursIds])
                         + ([OursIdsGather] if args.gather else [])) + [MlxLm] + ([OursHTTP] if args.http else [])
    engines = [k(path, max(streams)) for k in kinds]
    vocab = int(json.loads((path / "config.json").read_text()).get("vocab_size", 320))
    rows: list[dict[str, Any]] = []
    try:
        for e in engines:  # warm-up: compile paths, allocate the page pool
            e.run(2, prompts_for(2, args.prompt_tokens, vocab), 4)
        for s in streams:
            prompts = prompts_for(s * args.requests_per_stream, args.prompt_tokens, vocab)
            trials: dict[str, list[dict[str, float]]] = {e.name: [] for e in engines}
            for _ in range(args.num_trials):
                for e in engines:
                    wall, n, peak = timed(lambda: e.run(s, prompts, args.generation_tokens))
                    window = decode_window(getattr(e, "events", []), s)
                    trials[e.name].append({"tps": n / wall, "decode_only_tps": window, "wall_s": wall,
                                           "tokens": n, "peak_gb": peak})
                    print(f"streams {s:>3} {e.name:>15}: {n / wall:9.1f} tok/s end to end, decode only "
                          f"{window or 0:9.1f} tok/s ({n} tokens, {wall:.2f} s)", file=sys.stderr)
            for e in engines:
                t = trials[e.name]
                rows.append({"suite": "served", "model": args.tiny and f"tiny-{args.tiny}" or path.name,
                             "engine": e.name, "batch": s, "prompt_tokens": args.prompt_tokens, "kernels": kernels,
                             "generation_tokens": args.generation_tokens, "prompt_tps": 0.0, "ttft_ms": 0.0,
                             "decode_tps": statistics.median(x["tps"] for x in t),
                             "decode_only_tps": (statistics.median(x["decode_only_tps"] for x in t)
                                                 if all(x["decode_only_tps"] for x in t) else None),
                             "peak_gb": max(x["peak_gb"] for x in t), "trials": t})
            base = next(r for r in rows[-len(engines):] if r["engine"] == "mlx-lm")
            for r in rows[-len(engines):]:
                r["ratio_vs_mlx-lm"] = r["decode_tps"] / base["decode_tps"]
                r["decode_only_ratio_vs_mlx-lm"] = (r["decode_only_tps"] / base["decode_only_tps"]
                                                    if r["decode_only_tps"] and base["decode_only_tps"] else None)
    finally:
        for e in engines:
            e.close()
    doc = results_document(rows)
    print("| streams | engine | tokens/s end to end | vs mlx-lm | decode-only tokens/s | vs mlx-lm |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        d, dr = r["decode_only_tps"], r["decode_only_ratio_vs_mlx-lm"]
        print(f"| {r['batch']} | {r['engine']} | {r['decode_tps']:.1f} | {r['ratio_vs_mlx-lm']:.2f}x | "
              f"{f'{d:.1f}' if d else '-'} | {f'{dr:.2f}x' if dr else '-'} |")
    if args.json:
        write_json(doc, Path(args.json))


if __name__ == "__main__":
    main()
