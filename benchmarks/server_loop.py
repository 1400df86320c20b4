"""The server's event-loop CPU per streamed chunk: what ``mlx-infer serve`` spends on the GIL beside the engine.

The server's event loop (uvicorn, one thread) and the engine's step loop (one thread) share the GIL: every
millisecond the loop holds it per SSE chunk is one the engine thread may wait for. This runs the app with
uvicorn in a thread of this process (``ServerThread``) on a toy model of a real shape (``served.py``'s
``shape_dir``: a word-level tokenizer, so every token is text), streams ``--streams`` closed-loop
completions from a client process (``served_http.client_share``, as ``served.py --http`` does), and reads
the CPU time of the loop's thread and the engine's thread (``pthread_getcpuclockid``) around each round:

    python benchmarks/server_loop.py --streams 32 --requests 96 -g 64 --rounds 6

Loop CPU per chunk is the figure to compare across server changes (CPU time, not wall: the machine's
other load moves it less; still, compare medians of rounds, runs alternating).

Each round also splits a request's time to first token (means, so the parts add up to the mean TTFT; clocks
comparable across
processes: ``time.perf_counter`` is CLOCK_MONOTONIC on Linux and macOS): the client's send to the app's
entry (an ASGI probe around the app, matched by an ``x-rid`` header), the entry to the first body bytes
sent (parsing, submit, the engine's own TTFT, the first chunk's formatting), those bytes to the client;
and the engine's TTFT alone (``RequestResult.ttft_ms``: submit to first token).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from served_models import shape_dir  # noqa: E402
from served_http import _ready, client_share  # noqa: E402

#: Per request (by its x-rid): [app entry, first body bytes sent] (perf_counter).
SEEN: dict[int, list[float | None]] = {}


class Probe:
    """ASGI middleware recording when each request enters the app and when its first body bytes go out."""

    def __init__(self, app: object):
        self.app = app

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        rid = dict(scope.get("headers", [])).get(b"x-rid") if scope["type"] == "http" else None
        rec: list[float | None] = [time.perf_counter(), None]
        if rid is not None:
            SEEN[int(rid)] = rec

        async def probe_send(message: dict) -> None:
            if rec[1] is None and message["type"] == "http.response.body" and message.get("body"):
                rec[1] = time.perf_counter()
            await send(message)  # type: ignore[operator]

        await self.app(scope, receive, probe_send)  # type: ignore[operator]


def thread_cpu(thread: object) -> float:
    """Seconds of CPU the thread has used."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[attr-defined]


def engine_cpu(engine: object) -> float | None:
    """Seconds of CPU the engine thread has used (``None``: the engine runs in its own process)."""
    thread = getattr(engine, "_thread", None)
    return None if thread is None else thread_cpu(thread)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b", help="a served.py shape, at its toy sizes")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--requests", type=int, default=96, help="requests per round")
    p.add_argument("--prompt-tokens", "-p", type=int, default=16)
    p.add_argument("--generation-tokens", "-g", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--engine-process", action="store_true",
                   help="the engine in its own process (engine/process.py, serve's default); its thread's CPU is "
                        "then not read")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from mlx_infer.server import ServerThread, create_app
    from mlx_infer.server.run import ServeOptions, start_engine

    path = shape_dir(args.shape, True, Path(tempfile.mkdtemp(prefix="server-loop-")))
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    engine = start_engine(ServeOptions(model=str(path), max_batch=args.streams, memory_budget_gb=0.5,
                                       engine_process=args.engine_process))
    handles: list = []
    asubmit = engine.asubmit  # the server's way in (server/app.py)

    async def recording_submit(*a: object, **k: object) -> object:  # the engine-side TTFT of each request
        h = await asubmit(*a, **k)  # type: ignore[arg-type]
        handles.append(h)
        return h

    engine.asubmit = recording_submit  # type: ignore[method-assign]
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    clients.submit(_ready).result()
    rng = random.Random(0)
    rows = []
    try:
        with ServerThread(Probe(create_app(engine, model_id="m"))) as server:
            for i in range(args.rounds):
                work = [(j, [rng.randrange(5, vocab - 5) for _ in range(args.prompt_tokens)])
                        for j in range(args.requests)]
                SEEN.clear()
                handles.clear()
                loop0, eng0, t0 = thread_cpu(server._thread), engine_cpu(engine), time.perf_counter()
                tokens, _, events, sent = clients.submit(client_share, server.url, "m", args.streams, work,
                                                         args.generation_tokens).result()
                chunks, times = len(events), {}  # times: per request (send, first chunk's arrival)
                for t, r, _, _ in sorted(events):
                    times.setdefault(r, (sent[r], t))
                loop1, eng1, t1 = thread_cpu(server._thread), engine_cpu(engine), time.perf_counter()
                ms = lambda xs: 1e3 * statistics.fmean(xs)  # noqa: E731
                row = {"round": i, "tokens": tokens, "chunks": chunks, "wall_s": t1 - t0,
                       "loop_us_per_chunk": 1e6 * (loop1 - loop0) / chunks,
                       "engine_us_per_token": None if eng0 is None else 1e6 * (eng1 - eng0) / tokens,
                       "ttft_mean_ms": ms([f - s for s, f in times.values()]),
                       "send_to_app_mean_ms": ms([SEEN[r][0] - s for r, (s, _) in times.items()]),
                       "app_to_first_bytes_mean_ms": ms([SEEN[r][1] - SEEN[r][0] for r in times]),
                       "first_bytes_to_client_mean_ms": ms([f - SEEN[r][1] for r, (_, f) in times.items()]),
                       "engine_ttft_mean_ms": statistics.fmean(h.result().ttft_ms for h in handles)}
                rows.append(row)
                print(f"round {i}: {tokens} tokens in {chunks} chunks, {t1 - t0:.2f} s; loop CPU "
                      f"{row['loop_us_per_chunk']:.1f} us/chunk, engine thread CPU "
                      f"{row['engine_us_per_token'] or float('nan'):.1f} us/token; TTFT mean {row['ttft_mean_ms']:.1f} ms: send->app {row['send_to_app_mean_ms']:.1f}, "
                      f"app->first bytes {row['app_to_first_bytes_mean_ms']:.1f} (engine TTFT "
                      f"{row['engine_ttft_mean_ms']:.1f}), bytes->client {row['first_bytes_to_client_mean_ms']:.1f}",
                      flush=True)
    finally:
        clients.shutdown()
        engine.stop()
    median = statistics.median(r["loop_us_per_chunk"] for r in rows)
    print(f"median loop CPU {median:.1f} us/chunk over {len(rows)} rounds")
    if args.json:
        doc = {"machine": platform.platform(), "command": " ".join(sys.argv), "median_loop_us_per_chunk": median,
               "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
