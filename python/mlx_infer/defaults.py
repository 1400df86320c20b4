"""Every default value of mlx-infer, in one place, with why it is what it is.

The API, the engine, the server and the CLI read their defaults from here (import only: this module imports
nothing, so the CLI can build its parser without loading the server or MLX). Where two entry points differ on
purpose (the CLI's ``--max-tokens`` is mlx-lm's 100, the API's is 256), both are here, next to each other.
"""

from __future__ import annotations

# -- generation ------------------------------------------------------------------------------------------------
#: Tokens ``generate()`` / ``generate_text()`` / an engine request produce when not told.
MAX_TOKENS = 256
#: ``mlx-infer generate --max-tokens``: mlx-lm's ``mlx_lm.generate`` default, so the same command does the same.
CLI_MAX_TOKENS = 100
#: Prompt tokens per prefill forward of one request (``generate``, ``bench``): mlx-lm's ``prefill_step_size``.
PREFILL_STEP_SIZE = 2048

# -- the engine (continuous batching) --------------------------------------------------------------------------
#: Requests running at once (prefilling or decoding), per device type (``EngineConfig.max_batch=None``): on a GPU
#: vLLM's ``max_num_seqs`` (256: a step of more rows costs little more there); on a CPU, where a step's time grows
#: with its rows, 32.
MAX_BATCH = {"gpu": 256, "cpu": 32}
#: Prompt tokens per engine iteration, per device type: smaller than ``PREFILL_STEP_SIZE`` so a joining prompt
#: stalls the decoding streams for at most one chunk (vLLM's chunked prefill makes the same trade). On a GPU the
#: chunks ride in the decode step (engine/mixed.py) and 2048 lets a burst of 512-token prompts start four per
#: step (vLLM's online-serving ``max_num_batched_tokens`` is 2048 too); on a CPU, 512.
ENGINE_PREFILL_STEP_SIZE = {"gpu": 2048, "cpu": 512}
#: Tokens per KV page (vLLM's block size).
PAGE_SIZE = 16
#: Extra tokens a sliding-window layer keeps beyond its window, so a short rollback stays exact.
WINDOW_SLACK = 16
#: Requests waiting for admission before ``submit`` refuses more.
MAX_QUEUE = 4096
#: KV memory budget in GB; ``None`` sizes it from the device (engine/config.py: ``kv_budget``).
MEMORY_BUDGET_GB: float | None = None
#: Whether the engine's KV storage starts small and grows on demand up to the pool's (device-sized) cap, per device
#: type (``EngineConfig.grow_pool=None``): on both, so the process holds the KV its requests use, as mlx-lm's caches
#: grow with theirs, instead of the whole cap from the start (state/paged/growth.py). Off preallocates the cap.
GROW_KV_POOL = {"gpu": True, "cpu": True}
#: Whether an engine iteration's activations are held to the pool sizing's activation reserve by MLX's memory
#: limit (``EngineConfig.bound_activations=None``; engine/activations.py), by device type.
BOUND_ACTIVATIONS = {"gpu": True, "cpu": False}
#: The least activation reserve of a bounded step (a smaller limit would make the host wait on every kernel).
CEILING_FLOOR_BYTES = 64 << 20
#: The layers of a bounded step whose activations the reserve counts: MLX commits a CUDA graph every ~100 ops
#: (3-4 decoder layers of MLX's ops then; ~10 with today's fused kernels), and two of them, one building and one
#: running, keep the device busy; a step's deeper layers wait behind them instead of stacking up (H200, session 7:
#: all of llama-1B's 16 layers counted left the 1-stream peak 0.06 GB above mlx-lm's). ``MLX_INFER_CEILING_LAYERS``
#: overrides it (engine/activations.py; an A/B knob: at 1 stream llama-1B's own peak, 0.36 GB above its weights
#: and KV, is about this reserve, session 30).
CEILING_LAYERS = 8
#: A growth materializes the pages a step (or an admission) needs plus this share more: fewer, larger growths (each
#: changes the storage's shape, so the compiled step traces once more), at most this much unused KV memory.
KV_GROWTH_HEADROOM = 0.25
#: Materialized pages are rounded up to a multiple of this (few distinct storage shapes), and the storage starts at
#: one granule: 256 tokens at the default page size, mlx-lm's KV cache step (admission grows for what it admits
#: before a step runs, so the start only has to be small).
KV_GROWTH_GRANULE = 16

# -- the server ------------------------------------------------------------------------------------------------
HOST = "127.0.0.1"
PORT = 8080
#: A chat completion's ``max_tokens`` when the request gives none, and (``serve --max-tokens``) every request's cap.
SERVER_MAX_TOKENS = 512
#: A completion's ``max_tokens`` when the request gives none: OpenAI's API default.
COMPLETIONS_MAX_TOKENS = 16
#: On SIGINT/SIGTERM, seconds requests in flight get to finish before they are aborted.
DRAIN_TIMEOUT_S = 5.0
#: Seconds a client may take to send a request's headers, and its body.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
#: Largest request body accepted (413 beyond).
MAX_BODY_BYTES = 8 * 2**20
#: Endpoints open without ``--api-key``'s key.
PUBLIC_ENDPOINTS = ("health",)

#: The server's GIL switch interval (``sys.setswitchinterval``; Python's default is 5 ms), long so the threads hand the
#: GIL over where they block (the engine in MLX's eval, the event loop in its poll) rather than preempting each other
#: mid-work (server/run.py: switch_interval). H200, llama-1B, 32 streams, HTTP / in-process decode (e2e): 0.5 ms
#: 0.78x (0.75x), 5 ms 0.85x (0.81x), 20 ms 1.02-1.06x (0.95-0.99x), 50 ms 1.08x (0.96x), 100 ms 0.99x (0.92x).
SERVER_SWITCH_INTERVAL_S = 0.02
