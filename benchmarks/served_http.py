"""``served.py``'s HTTP column: ``mlx-infer serve`` in its own process, streamed over loopback by
clients in several processes.

One Python process parsing every SSE event of 64-128 streams (httpx, one asyncio loop) can be
the bottleneck of the measurement rather than the server: the streams are spread over client
processes (``clients``, default one per 16 streams of the largest count; a trial of fewer streams uses as
few of them as keep each at ``max_batch / clients`` streams or fewer), started once with the column and reused by
every trial. Each process runs its share of the streams as a closed loop over its share of the
prompts and hands back its tokens, TTFTs and event times (``time.perf_counter``: CLOCK_MONOTONIC,
comparable across processes on Linux and macOS), from which ``served.py`` takes the decode window.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

#: Streams one client process serves (the default number of processes: streams / this, at least one).
STREAMS_PER_CLIENT = 16


def client_share(url: str, model: str, streams: int, work: list[tuple[int, list[int]]],
                 gen: int) -> tuple[int, list[float], list[tuple[float, int, bool, int]], dict[int, float]]:
    """``streams`` closed-loop streams over ``work`` ((request number, prompt) pairs), in this process.
    Returns the completion tokens the server counted, each request's TTFT (s), every chunk's
    ``(arrival, request number, finished, tokens)`` (a chunk carries every token that was ready when the
    server's loop sent it, server/app.py, counted from the running usage: ``continuous_usage_stats``) and
    each request's send time. Each request carries its number in an ``x-rid`` header (server_loop.py's
    probe matches on it)."""
    import httpx

    ttfts: list[float] = []
    events: list[tuple[float, int, bool, int]] = []
    sent: dict[int, float] = {}

    async def main() -> int:
        queue = list(work)
        total = 0
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            async def stream() -> None:
                nonlocal total
                while queue:
                    rid, prompt = queue.pop(0)
                    body = {"model": model, "prompt": prompt, "max_tokens": gen, "stream": True,
                            "ignore_eos": True, "temperature": 0,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                    t0, first, seen = time.perf_counter(), True, 0
                    sent[rid] = t0
                    async with client.stream("POST", "/v1/completions", json=body,
                                             headers={"x-rid": str(rid)}) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                done = chunk["usage"]["completion_tokens"]  # the running count so far
                                if chunk.get("choices"):
                                    now = time.perf_counter()
                                    if first:
                                        ttfts.append(now - t0)
                                        first = False
                                    events.append((now, rid, chunk["choices"][0].get("finish_reason") is not None,
                                                   done - seen))
                                seen = done
                    total += seen
            await asyncio.gather(*(stream() for _ in range(streams)))
        return total

    total = asyncio.run(main())
    return total, ttfts, events, sent


def _ready() -> bool:
    """Import the client's modules in a worker once, before any timed trial."""
    import httpx

    return httpx.AsyncClient is not None


def client_parts(streams: int, clients: int, per_client: int) -> int:
    """How many of the ``clients`` processes a trial of ``streams`` uses: as few as keep each at ``per_client``
    streams or fewer."""
    return max(1, min(clients, math.ceil(streams / per_client)))


def split(streams: int, prompts: list[list[int]], parts: int) -> list[tuple[int, list[tuple[int, list[int]]]]]:
    """``(streams, work)`` of each client process: streams dealt evenly, the prompts (numbered) in
    proportion, so every process keeps its streams busy for the same number of requests each."""
    parts = max(1, min(parts, streams))
    per = [streams // parts + (1 if i < streams % parts else 0) for i in range(parts)]
    numbered = list(enumerate(prompts))
    out, start = [], 0
    for i, n in enumerate(per):
        take = round(len(numbered) * n / streams) if i < parts - 1 else len(numbered) - start
        out.append((n, numbered[start:start + take]))
        start += take
    return out


class OursHTTP:
    """``mlx-infer serve`` in its own process; client processes stream completions over loopback."""

    name = "mlx-infer-http"
    flags: tuple[str, ...] = ()  # the engine in its own process: serve's default

    def __init__(self, path: Path, max_batch: int, budget_gb: float | None = None, clients: int | None = None,
                 pyspy: str | None = None):
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="served-http-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_infer", "serve", "--model", str(path),
                                      "--port", str(port), "--max-batch", str(max_batch), "--log-level", "warning",
                                      *(["--memory-budget", str(budget_gb)] if budget_gb else []), *self.flags],
                                     stdout=self.log)
        self.model = path.name
        self.pyspy, self.pyspy_proc = pyspy, None  # --http-pyspy: one GIL profile, of the first trial of 16+ streams
        self.sizing = f"--memory-budget {budget_gb:g}" if budget_gb else "default device sizing (own phase)"
        self.clients = clients or max(1, math.ceil(max_batch / STREAMS_PER_CLIENT))
        self.streams_per_client = math.ceil(max_batch / self.clients)  # a trial's streams spread over the clients
        self.pool_executor = ProcessPoolExecutor(self.clients, mp_context=multiprocessing.get_context("spawn"))
        for f in [self.pool_executor.submit(_ready) for _ in range(self.clients)]:
            f.result(timeout=120)
        self.pool = ""
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    self.log.seek(0)
                    self.pool = next((ln.strip() for ln in self.log if "KV pages" in ln), "")
                    print(self.pool, file=sys.stderr)
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("mlx-infer serve did not start")

    def run(self, streams: int, prompts: list[list[int]], gen: int) -> int:
        """One trial: ``streams`` closed-loop streams over ``prompts``; sets ``ttfts`` and ``events``."""
        if self.pyspy and streams >= STREAMS_PER_CLIENT:
            self.pyspy_proc, self.pyspy = profile_gil(self.proc.pid, self.pyspy), None  # once
        parts = split(streams, prompts, client_parts(streams, self.clients, self.streams_per_client))
        futures = [self.pool_executor.submit(client_share, self.url, self.model, n, work, gen) for n, work in parts]
        self.ttfts, self.events = [], []
        total = 0
        for f in futures:
            t, ttfts, events, _ = f.result()
            total += t
            self.ttfts += ttfts
            self.events += events
        self.events.sort()
        return total

    def _metric(self, name: str) -> float | None:
        """One sample of the server's /metrics (``mlx_infer_`` + ``name``), or None where absent."""
        import httpx

        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(f"mlx_infer_{name} "):
                return float(line.split()[-1])
        return None

    def peak_gb(self) -> float | None:
        """The server process's MLX peak memory (its /metrics), GB."""
        peak = self._metric("memory_peak_bytes")
        return None if peak is None else peak / 1e9

    def histogram(self, name: str) -> tuple[float, int] | None:
        """(sum of seconds, count) of one of the server's /metrics histograms: the engine's
        ``time_to_first_token_seconds`` (the client's TTFT less the server's and the loopback's share) or the
        server's ``http_time_to_first_chunk_seconds`` (less the loopback's and the client's)."""
        total, count = self._metric(name + "_sum"), self._metric(name + "_count")
        return None if total is None or count is None else (total, int(count))

    def close(self) -> None:
        if self.pyspy_proc is not None:
            self.pyspy_proc.wait(timeout=60)
        self.pool_executor.shutdown()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


class OursHTTPThread(OursHTTP):
    """The same server with its engine as a thread of the server's process (``--no-engine-process``):
    the A/B of the engine process (``served.py --http-thread``)."""

    name = "mlx-infer-http-thread"
    flags = ("--no-engine-process",)


def profile_gil(pid: int, out: str, seconds: int = 6) -> subprocess.Popen | None:
    """py-spy sampling the server's GIL holder (``--gil``: which thread holds it, and where) for ``seconds``,
    in the background (collapsed stacks to ``out``); None (and a note) where py-spy is missing."""
    import shutil

    near = [Path(sys.executable).parent / "py-spy"] + [Path(p) / "bin" / "py-spy" for p in sys.path if p]  # venv, --target
    exe = shutil.which("py-spy") or next((str(p) for p in near if p.exists()), None)
    if exe is None:
        print("--http-pyspy: py-spy not found (pip install py-spy)", file=sys.stderr)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "500", "--gil",
                             "--threads", "--nonblocking", "--format", "raw", "-o", out])


def describe(e: Any) -> dict[str, Any]:
    """What the JSON row records about the column's clients."""
    return {"http_clients": e.clients, "streams_per_client": e.streams_per_client}
