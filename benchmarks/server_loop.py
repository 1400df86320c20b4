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

from served import shape_dir  # noqa: E402
from served_http import _ready, client_share  # noqa: E402


def thread_cpu(thread: object) -> float:
    """Seconds of CPU the thread has used."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b", help="a served.py shape, at its toy sizes")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--requests", type=int, default=96, help="requests per round")
    p.add_argument("--prompt-tokens", "-p", type=int, default=16)
    p.add_argument("--generation-tokens", "-g", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from mlx_infer.artifacts.loader import load_model
    from mlx_infer.engine import Engine, EngineConfig
    from mlx_infer.server import ServerThread, create_app

    path = shape_dir(args.shape, True, Path(tempfile.mkdtemp(prefix="server-loop-")))
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    engine = Engine(load_model(path), EngineConfig(max_batch=args.streams, memory_budget_gb=0.5)).start()
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    clients.submit(_ready).result()
    rng = random.Random(0)
    rows = []
    try:
        with ServerThread(create_app(engine, model_id="m")) as server:
            for i in range(args.rounds):
                work = [(j, [rng.randrange(5, vocab - 5) for _ in range(args.prompt_tokens)])
                        for j in range(args.requests)]
                loop0, eng0, t0 = thread_cpu(server._thread), thread_cpu(engine._thread), time.perf_counter()
                tokens, _, events = clients.submit(client_share, server.url, "m", args.streams, work,
                                                   args.generation_tokens).result()
                loop1, eng1, t1 = thread_cpu(server._thread), thread_cpu(engine._thread), time.perf_counter()
                row = {"round": i, "tokens": tokens, "chunks": len(events), "wall_s": t1 - t0,
                       "loop_us_per_chunk": 1e6 * (loop1 - loop0) / len(events),
                       "engine_us_per_token": 1e6 * (eng1 - eng0) / tokens}
                rows.append(row)
                print(f"round {i}: {tokens} tokens in {len(events)} chunks, {t1 - t0:.2f} s; loop CPU "
                      f"{row['loop_us_per_chunk']:.1f} us/chunk, engine thread CPU {row['engine_us_per_token']:.1f} "
                      "us/token", flush=True)
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
