"""Engine counters and their Prometheus text form."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: Seconds of history behind the tokens/s gauges.
RATE_WINDOW_S = 10.0

#: Upper bounds (seconds) of the latency histograms' buckets: vLLM's for time to first token and end-to-end
#: request latency, so dashboards built for one read the other.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: Upper bounds (seconds) of the inter-token latency histogram's buckets: from 1 ms (a decode step of a small
#: model on a GPU) to vLLM's 80 s.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    """Observations counted into cumulative buckets (Prometheus's histogram), with their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative); the last is +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``value`` ``n`` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def snapshot(self) -> dict[str, Any]:
        """``{"buckets": [(upper bound, cumulative count), ..., (inf, count)], "sum": s, "count": n}``."""
        cumulative = list(itertools.accumulate(self.counts))
        return {"buckets": list(zip([*self.bounds, math.inf], cumulative)), "sum": self.sum, "count": self.count}


@dataclass
class EngineMetrics:
    """Counters the engine thread updates; :meth:`snapshot` reads them from any thread."""

    requests_total: dict[str, int] = field(default_factory=dict)  # by finish reason
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    prefill_tokens_total: int = 0
    generation_tokens_total: int = 0
    decode_steps_total: int = 0
    preemptions_total: int = 0
    rejected_total: int = 0
    forwards_total: int = 0
    forced_tokens_total: int = 0
    grammar_jump_forwards_saved_total: int = 0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    _gen: deque = field(default_factory=deque)  # (time, tokens) of recent decode steps
    _pre: deque = field(default_factory=deque)  # (time, tokens) of recent prefill chunks
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finished(self, reason: str, latency_s: float | None = None) -> None:
        """A request ended with ``reason``, ``latency_s`` after the engine took it (its submit)."""
        with self._lock:
            self.requests_total[reason] = self.requests_total.get(reason, 0) + 1
            if latency_s is not None:
                self.e2e_request_latency.observe(latency_s)

    def first_token(self, seconds: float) -> None:
        """A request's first token was read out, ``seconds`` after the engine took it: the engine's own
        time to first token (queueing, prefill and the step included; the HTTP server's hops not)."""
        with self._lock:
            self.time_to_first_token.observe(seconds)

    def inter_token(self, gaps: dict[float, int], now: float) -> None:
        """Tokens read out at ``now``, after their sequences' previous tokens: ``gaps`` maps a previous token's
        time to how many rows had it (a step's rows mostly share one), so a step costs one observation per
        distinct gap, not one per row."""
        with self._lock:
            for prev, n in gaps.items():
                self.inter_token_latency.observe(now - prev, n)

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens_total += prompt_tokens
            self.cached_tokens_total += cached_tokens

    def prefilled(self, n: int) -> None:
        with self._lock:
            self.prefill_tokens_total += n
            self._push(self._pre, n)

    def generated(self, n: int) -> None:
        with self._lock:
            self.generation_tokens_total += n
            self.decode_steps_total += 1
            self._push(self._gen, n)

    def forward(self) -> None:
        """One model forward ran (a prefill chunk's, or a decode step's)."""
        with self._lock:
            self.forwards_total += 1

    def forced(self) -> None:
        """A constraint forced one emitted token (see engine/grammar_jump.py)."""
        with self._lock:
            self.forced_tokens_total += 1

    def jumped(self, span: int) -> None:
        """``span`` forced tokens were emitted outside a step (grammar jump): each is a row forward saved."""
        with self._lock:
            self.generation_tokens_total += span
            self.grammar_jump_forwards_saved_total += span
            self._push(self._gen, span)

    def _push(self, q: deque, n: int) -> None:
        now = time.monotonic()
        q.append((now, n))
        while q and q[0][0] < now - RATE_WINDOW_S:
            q.popleft()

    @staticmethod
    def _rate(q: deque) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in q if t >= now - RATE_WINDOW_S]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from cached pages."""
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests_total": dict(self.requests_total),
                "prompt_tokens_total": self.prompt_tokens_total,
                "cached_tokens_total": self.cached_tokens_total,
                "prefill_tokens_total": self.prefill_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "decode_steps_total": self.decode_steps_total,
                "preemptions_total": self.preemptions_total,
                "rejected_total": self.rejected_total,
                "forwards_total": self.forwards_total,
                "forced_tokens_total": self.forced_tokens_total,
                "grammar_jump_forwards_saved_total": self.grammar_jump_forwards_saved_total,
                "generation_tokens_per_second": self._rate(self._gen),
                "prompt_tokens_per_second": self._rate(self._pre),
                "prefix_hit_rate": self.prefix_hit_rate,
                "time_to_first_token_seconds": self.time_to_first_token.snapshot(),
                "e2e_request_latency_seconds": self.e2e_request_latency.snapshot(),
                "inter_token_latency_seconds": self.inter_token_latency.snapshot(),
            }


_HELP = {
    "queue_depth": ("gauge", "Requests waiting for admission."),
    "running": ("gauge", "Requests holding KV pages (prefilling or decoding)."),
    "requests_total": ("counter", "Finished requests by finish reason."),
    "prompt_tokens_total": ("counter", "Prompt tokens admitted (cached ones included)."),
    "cached_tokens_total": ("counter", "Prompt tokens served from the prefix cache."),
    "prefill_tokens_total": ("counter", "Tokens computed by prefill chunks."),
    "generation_tokens_total": ("counter", "Tokens generated."),
    "decode_steps_total": ("counter", "Batched decode steps run."),
    "preemptions_total": ("counter", "Requests preempted (pages freed, recomputed later)."),
    "rejected_total": ("counter", "Requests refused at submit (queue full)."),
    "forwards_total": ("counter", "Model forwards run (prefill chunks and decode steps)."),
    "forced_tokens_total": ("counter", "Generated tokens a constraint forced (committed without sampling)."),
    "grammar_jump_forwards_saved_total": ("counter", "Row forwards grammar jump saved (forced tokens fed in one)."),
    "generation_tokens_per_second": ("gauge", f"Generated tokens/s over the last {RATE_WINDOW_S:.0f} s."),
    "prompt_tokens_per_second": ("gauge", f"Prefilled tokens/s over the last {RATE_WINDOW_S:.0f} s."),
    "prefix_hit_rate": ("gauge", "cached_tokens_total / prompt_tokens_total."),
    "kv_pages_total": ("gauge", "Usable KV pages of the pool's capacity (the null page excluded)."),
    "kv_pages_used": ("gauge", "KV pages referenced by live sequences."),
    "kv_pages_free": ("gauge", "KV pages allocatable within the capacity (free, evictable cached, not yet materialized)."),
    "kv_pages_materialized": ("gauge", "KV pages whose storage exists (the null page excluded); grows on demand."),
    "kv_pool_growths_total": ("counter", "Times the KV storage grew (each retraces the compiled step once)."),
    "kv_pages_cached": ("gauge", "Free KV pages still indexed by the prefix cache."),
    "kv_page_usage": ("gauge", "kv_pages_used / kv_pages_total."),
    "memory_active_bytes": ("gauge", "MLX active memory."),
    "memory_peak_bytes": ("gauge", "MLX peak memory."),
    "time_to_first_token_seconds": ("histogram", "Seconds from a request's submit to the engine to its first "
                                                 "token read out (the HTTP server's hops not included)."),
    "e2e_request_latency_seconds": ("histogram", "Seconds from a request's submit to the engine to its end."),
    "inter_token_latency_seconds": ("histogram", "Seconds between a sequence's consecutive tokens read out of the "
                                                 "engine's steps (its first token's wait is in time to first "
                                                 "token)."),
    "http_time_to_first_chunk_seconds": ("histogram", "Seconds from a streamed request's arrival at the server's "
                                                      "endpoint to its first SSE chunk (a chat stream's: its role "
                                                      "chunk)."),
}


def prometheus_text(values: dict[str, Any], prefix: str = "mlx_infer_") -> str:
    """Render engine values in the Prometheus text exposition format (0.0.4)."""
    lines = []
    for name, value in values.items():
        kind, help_text = _HELP.get(name, ("gauge", name))
        full = prefix + name
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} {kind}")
        if kind == "histogram":
            for bound, n in value["buckets"]:
                le = "+Inf" if math.isinf(bound) else f"{bound:g}"
                lines.append(f'{full}_bucket{{le="{le}"}} {n}')
            lines.append(f"{full}_sum {float(value['sum']):.6g}")
            lines.append(f"{full}_count {value['count']}")
        elif isinstance(value, dict):
            for label, v in sorted(value.items()):
                lines.append(f'{full}{{finish_reason="{label}"}} {v}')
        else:
            lines.append(f"{full} {float(value):.6g}" if isinstance(value, float) else f"{full} {value}")
    return "\n".join(lines) + "\n"


#: The metrics ``Engine.prometheus`` exports, in order.
PROMETHEUS_ORDER = ("queue_depth", "running", "requests_total", "prompt_tokens_total", "cached_tokens_total",
                    "prefill_tokens_total", "generation_tokens_total", "decode_steps_total", "preemptions_total",
                    "rejected_total", "forwards_total", "forced_tokens_total",
                    "grammar_jump_forwards_saved_total", "generation_tokens_per_second", "prompt_tokens_per_second",
                    "prefix_hit_rate", "kv_pages_total", "kv_pages_used", "kv_pages_free", "kv_pages_cached",
                    "kv_page_usage", "kv_pages_materialized", "kv_pool_growths_total", "memory_active_bytes",
                    "memory_peak_bytes", "time_to_first_token_seconds", "e2e_request_latency_seconds",
                    "inter_token_latency_seconds")


def pool_gauges(store: Any) -> dict[str, Any]:
    """The KV pool gauges of a :class:`~mlx_infer.state.paged.PagedKVStore`, summed over its layer groups."""
    pools = [store.pages.pool(g.index) for g in store.groups]
    total = sum(p.num_pages - 1 for p in pools)
    used = sum(p.num_used_pages() for p in pools)
    return {"kv_pages_total": total, "kv_pages_used": used,
            "kv_pages_free": sum(store.free_pages()),
            "kv_pages_cached": sum(p.num_cached_pages() for p in pools),
            "kv_page_usage": used / total if total else 0.0,
            "kv_pages_materialized": sum(p.materialized - 1 for p in pools),
            "kv_pool_growths_total": store.growths}
