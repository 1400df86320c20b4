"""Engine settings and how the KV page pool is sized: from the device's memory by default, or
from an explicit memory budget.

Default (``memory_budget_gb=None``), as vLLM's ``gpu_memory_utilization``::

    GPU   KV bytes = fraction x (recommended working set, else total memory)
                     - held by this process - held by other processes - activation reserve
    CPU   KV bytes = fraction x available RAM - activation reserve
                     (what this process holds is already out of what is available)

``held`` is what this process already holds on the device when the engine is built:
``mx.get_active_memory()`` (our weights, any other model loaded in the process, such as
mlx-lm's beside us in a benchmark, and anything else allocated), never less than our own
weights (which may not be materialized yet). ``held by other processes`` is, where the device
reports its free memory (CUDA does), total - free - what this process holds (active and MLX's
buffer cache): a second server started beside a first one gets what the first left, not the
whole device again (Metal reports no free memory: 0 there). The activation reserve is
:func:`activation_reserve` (at least :data:`ACTIVATION_RESERVE_BYTES`).

``fraction`` is ``memory_fraction`` (default 0.8 on a GPU, below MLX's own 0.95 cap; 0.25 on the CPU,
whose RAM the OS and other processes share: vLLM's CPU backend likewise
defaults to a fixed 4 GiB of KV rather than most of the RAM). An explicit budget gives
:data:`KV_FRACTION` of it to KV pages. Either way no group holds more than
its sequences can use (see :func:`pool_pages`).

That figure is the pool's *capacity* (vLLM's ``gpu_memory_utilization`` is a limit too). With
``grow_pool`` (the default) the storage starts at :func:`initial_pages` and grows on demand up
to it (state/paged/growth.py), so the process holds the KV its requests use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import defaults
from ..errors import MlxInferError
from ..state.paged import DEFAULT_WINDOW_SLACK, model_geometry
from ..state.paged.growth import PoolGrowth

DEFAULT_MAX_BATCH = defaults.MAX_BATCH  # per device type
DEFAULT_PAGE_SIZE = defaults.PAGE_SIZE
DEFAULT_PREFILL_STEP_SIZE = defaults.ENGINE_PREFILL_STEP_SIZE  # per device type
DEFAULT_MEMORY_BUDGET_GB: float | None = defaults.MEMORY_BUDGET_GB  # None: sized from the device
#: Share of the device's memory the default sizing lets the engine use, per device type.
#: On a GPU, 0.8: MLX's CUDA allocator caps the process at 0.95 of the device and trims its buffer cache
#: whenever active + cached memory reaches that cap (or the CUDA pool's reserve does), so a pool sized to 0.9
#: leaves the cache almost no room and allocations churn (H200, llama-1B, a 120 GiB pool: some trials of a
#: served run took 3-8x longer than others; benchmarks/RESULTS.md).
DEFAULT_MEMORY_FRACTION = {"gpu": 0.8, "cpu": 0.25}
#: The least memory kept free for activations (prefill chunks, the step's logits) and MLX's buffer cache.
ACTIVATION_RESERVE_BYTES = 1 << 30
#: :func:`activation_reserve`'s factor over one iteration's estimate: the pipelined decode
#: queues step n+1 while step n's buffers are alive, and MLX's buffer cache keeps freed ones.
ACTIVATION_SAFETY = 2
DEFAULT_MAX_QUEUE = defaults.MAX_QUEUE
#: Fraction of the memory budget given to KV pages; the rest is headroom for
#: activations (prefill chunks, the batched decode step's gathers and logits).
KV_FRACTION = 0.8
_FALLBACK_CONTEXT = 8192


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine schedules and how much memory it may use.

    Args:
        max_batch: most requests running at once (prefilling or decoding); ``None``: the
            device type's default (:data:`~mlx_infer.defaults.MAX_BATCH`: 256 on a GPU, 32 on a CPU).
        memory_budget_gb: memory for KV pages plus activations, weights
            excluded; :data:`KV_FRACTION` of it sizes the page pool (admission
            is by free pages, so the KV never outgrows it; the rest is headroom
            for activations, which ``prefill_step_size`` and ``max_batch`` bound).
            ``None`` (the default): sized from the device, less what this process and
            others already hold there (module docstring).
        memory_fraction: the share of the device's memory the default sizing
            may use (``None``: :data:`DEFAULT_MEMORY_FRACTION` of the device type).
        memory_limit_gb: optionally also hold admissions while MLX's active
            memory (the whole process: other models too) exceeds this.
        num_pages: explicit pool size (null page included); overrides the budget's.
        page_size: tokens per KV page (a power of two).
        prefill_step_size: prompt tokens computed per engine iteration (the
            chunk that sits between two decode steps, or rides in one); ``None``: the device
            type's default (:data:`~mlx_infer.defaults.ENGINE_PREFILL_STEP_SIZE`: 2048 on a GPU, 512 on a CPU).
        max_queue: waiting requests beyond which ``submit`` refuses new ones.
        prefix_cache: index finished prompts' full pages for reuse.
        pipeline: queue decode step n+1 before reading step n's tokens.
        mixed_steps: while requests decode, prompt chunks of joining requests ride in the
            decode step's forward (one prompt-token budget per step: ``prefill_step_size``;
            see engine/mixed.py) where the compiled step's attention reads the block tables.
            ``None`` (default): on a GPU only. On this project's 2-core CPU a joining
            512-token prompt's first token came later mixed (79-122 ms) than prefilled in
            its own forward (44-45 ms; toy gemma3-270m shape, benchmarks/join_ttft.py): the
            CPU kernel attends row by row where the separate prefill uses MLX's SDPA.
        bound_activations: hold each iteration's activations to the reserve the pool sizing left
            for them (:func:`activation_reserve`), with MLX's memory limit set for the iteration
            (engine/activations.py): MLX keeps a command buffer's inputs alive until the device
            has run it, so a 2,048-row prompt-chunk step would hold gigabytes at once. ``None``
            (default): :data:`~mlx_infer.defaults.BOUND_ACTIVATIONS` of the device type.
        kv_scheme: per-layer KV storage (see :class:`~mlx_infer.state.paged.PagedKVStore`).
        kv_dtype: element type of plain KV storage (default: the model's).
        grow_pool: the KV storage starts at :func:`initial_pages` and grows on demand up to the
            pool's capacity (the budget's, or ``num_pages``) by the default
            :class:`~mlx_infer.state.paged.growth.PoolGrowth` (``True``) or the one given;
            ``False`` allocates the whole capacity up front. ``None`` (default):
            :data:`~mlx_infer.defaults.GROW_KV_POOL` of the device type (on for GPU and CPU).
    """

    max_batch: int | None = None
    memory_budget_gb: float | None = DEFAULT_MEMORY_BUDGET_GB
    memory_fraction: float | None = None
    memory_limit_gb: float | None = None
    num_pages: int | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    prefill_step_size: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    prefix_cache: bool = True
    pipeline: bool = True
    mixed_steps: bool | None = None
    bound_activations: bool | None = None
    kv_scheme: Any = None
    kv_dtype: mx.Dtype | None = None
    grow_pool: bool | PoolGrowth | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "page_size", "prefill_step_size", "max_queue"):
            v = getattr(self, name)
            if v is None and name in ("max_batch", "prefill_step_size"):
                continue  # the device type's default (for_device)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MlxInferError(f"EngineConfig.{name} must be a positive integer, got {v!r}.")
        if self.page_size & (self.page_size - 1):
            raise MlxInferError(f"EngineConfig.page_size must be a power of two, got {self.page_size}.")
        if self.memory_budget_gb is not None and (isinstance(self.memory_budget_gb, bool) or not isinstance(
                self.memory_budget_gb, (int, float)) or not self.memory_budget_gb > 0):
            raise MlxInferError(f"EngineConfig.memory_budget_gb must be > 0, got {self.memory_budget_gb!r}.")
        if self.memory_fraction is not None and (isinstance(self.memory_fraction, bool) or not isinstance(
                self.memory_fraction, (int, float)) or not 0 < self.memory_fraction <= 1):
            raise MlxInferError(f"EngineConfig.memory_fraction must be in (0, 1], got {self.memory_fraction!r}.")
        if self.memory_limit_gb is not None and not (isinstance(self.memory_limit_gb, (int, float))
                                                     and self.memory_limit_gb > 0):
            raise MlxInferError(f"EngineConfig.memory_limit_gb must be > 0, got {self.memory_limit_gb!r}.")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise MlxInferError(f"EngineConfig.num_pages must be an integer >= 2, got {self.num_pages!r}.")
        if self.bound_activations is not None and not isinstance(self.bound_activations, bool):
            raise MlxInferError(f"EngineConfig.bound_activations must be True, False or None (the device type's "
                                f"default), got {self.bound_activations!r}.")
        if self.grow_pool is not None and not isinstance(self.grow_pool, (bool, PoolGrowth)):
            raise MlxInferError(f"EngineConfig.grow_pool must be True, False, a PoolGrowth or None (the device "
                                f"type's default), got {self.grow_pool!r}.")


    def for_device(self, kind: str | None = None) -> "EngineConfig":
        """This config with its device-dependent defaults (``None`` fields) filled in for ``kind``
        (``"gpu"`` / ``"cpu"``; default: MLX's default device's type)."""
        if self.max_batch is not None and self.prefill_step_size is not None:
            return self
        kind = kind or ("gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu")
        return replace(self, max_batch=self.max_batch or DEFAULT_MAX_BATCH[kind],
                       prefill_step_size=self.prefill_step_size or DEFAULT_PREFILL_STEP_SIZE[kind])


@dataclass(frozen=True)
class KVBudget:
    """Bytes the page pool may take (its capacity: with ``grow_pool`` the storage starts small and
    grows to it on demand) and where the figure came from (the startup line says both)."""

    bytes: int
    source: str


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def available_ram() -> int:
    """Bytes of RAM available to new allocations (psutil, else /proc/meminfo's MemAvailable)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    raise MlxInferError("Cannot tell the available RAM (no psutil, no /proc/meminfo); pass --memory-budget.")


def device_memory() -> tuple[str, int, str]:
    """``(device type, bytes, what they are)`` of the default device: a GPU's recommended
    working set (else its total memory), or the CPU's available RAM."""
    if mx.default_device().type == mx.DeviceType.gpu:
        info = mx.device_info()
        for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
            if info.get(key):
                return "gpu", int(info[key]), key.replace("_", " ")
        raise MlxInferError(f"The GPU reports no memory size ({sorted(info)}); pass --memory-budget.")
    return "cpu", available_ram(), "available RAM"


def model_sizes(model: Any) -> tuple[int, int, int]:
    """``(hidden, intermediate, vocab)`` sizes from the model's args (0 where it has none)."""
    args = getattr(model, "args", None)
    args = getattr(args, "text_config", None) or args  # multimodal wrappers nest the text model's
    get = (args.get if isinstance(args, dict) else lambda k, d: getattr(args, k, d))
    return tuple(int(get(k, 0) or 0) for k in ("hidden_size", "intermediate_size", "vocab_size"))


def activation_reserve(model: Any, config: EngineConfig) -> int:
    """Bytes kept free for one engine iteration's activations, never less than
    :data:`ACTIVATION_RESERVE_BYTES`.

    One iteration runs at most ``max_batch`` decode rows plus one prompt chunk of
    ``prefill_step_size`` rows (mixed steps share that prompt-token budget), and gets logits
    for the decode rows and one last row per chunk. So::

        ACTIVATION_SAFETY x ((max_batch + prefill_step_size) x (3 hidden + 2 intermediate) x dtype bytes
                             + (max_batch + 1) x vocab x 4 bytes x 2)

    (residual, normed input and attention output; the MLP's gate and up; float32 logits and
    their log-softmax). Llama 3.2 1B at 32 x 512: about 0.12 GiB, so the 1 GiB floor binds;
    it grows with ``max_batch`` and ``prefill_step_size``.
    """
    config = config.for_device()
    hidden, intermediate, vocab = model_sizes(model)
    rows = config.max_batch + config.prefill_step_size
    per_step = (rows * (3 * hidden + 2 * intermediate) * model_dtype(model).size
                + (config.max_batch + 1) * vocab * 4 * 2)
    return max(ACTIVATION_RESERVE_BYTES, ACTIVATION_SAFETY * per_step)


def kv_budget(model: Any, config: EngineConfig) -> KVBudget:
    """What the page pool may take under ``config`` (module docstring)."""
    if config.memory_budget_gb is not None:
        return KVBudget(int(config.memory_budget_gb * 2**30 * KV_FRACTION),
                        f"{KV_FRACTION:.0%} of --memory-budget {config.memory_budget_gb:g} GB")
    kind, capacity, what = device_memory()
    fraction = config.memory_fraction if config.memory_fraction is not None else DEFAULT_MEMORY_FRACTION[kind]
    reserve = activation_reserve(model, config)
    gib = 2**30
    if kind == "gpu":
        held = max(int(mx.get_active_memory()), weight_bytes(model))
        kv = int(capacity * fraction) - held
        source = f"{fraction:g} x {what} {capacity / gib:.1f} GiB - held by this process {held / gib:.1f} GiB"
        free = mx.device_info().get("free_memory")
        if free:
            others = max(0, capacity - int(free) - int(mx.get_active_memory()) - int(mx.get_cache_memory()))
            kv -= others
            source += f" - held by other processes {others / gib:.1f} GiB"
    else:
        kv = int(capacity * fraction)
        source = f"{fraction:g} x {what} {capacity / gib:.1f} GiB"
    kv -= reserve
    source += f" - activations {reserve / gib:.2f} GiB"
    bank = getattr(model, "adapter_bank", None)  # its stacks span every slot: resident adapters fit in this
    if bank is not None and bank.nbytes:
        kv -= bank.nbytes
        source += f" - adapters {bank.nbytes / gib:.3f} GiB"
    if kv <= 0:
        raise MlxInferError(f"The device leaves no memory for KV pages ({source} <= 0); pass "
                            "--memory-budget (GB), a larger memory fraction, or free the device.")
    return KVBudget(kv, source)


def model_dtype(model: Any) -> mx.Dtype:
    """The dtype activations (and so plain KV) take: the first floating parameter's."""
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32


def kv_page_bytes(model: Any, page_size: int, dtype: mx.Dtype | None = None) -> int:
    """Bytes one page takes over every layer (K and V, plain storage)."""
    windows, kv_heads, head_dim = model_geometry(model)
    itemsize = (dtype or model_dtype(model)).size
    return len(windows) * 2 * kv_heads * page_size * head_dim * itemsize


def pool_pages(model: Any, config: EngineConfig, context_length: int | None,
               budget: KVBudget | None = None) -> list[int]:
    """Pages of each layer group's pool (the store's group order: global, then windows ascending).

    An explicit ``num_pages`` sizes every group. Otherwise every group starts
    from the pages ``budget`` (default :func:`kv_budget`) holds over all layers; a
    sliding-window group keeps no more than ``max_batch`` sequences hold at
    most (window + slack + one prefill chunk each), and the global group
    takes the bytes that frees, never more than the engine can use: ``max_batch``
    full contexts for the running sequences, plus (with ``prefix_cache``) as many
    again for finished prefixes kept cached. Each count includes the null page.
    """
    config = config.for_device()
    windows, kv_heads, head_dim = model_geometry(model)
    keys = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if config.num_pages is not None:
        return [config.num_pages] * len(keys)
    P = config.page_size
    per_page = kv_page_bytes(model, P, config.kv_dtype)
    layer_page = per_page // len(windows)  # one page of one layer, K and V
    budget = budget or kv_budget(model, config)
    source, budget = budget.source, budget.bytes
    even = budget // per_page
    if even < 2:
        raise MlxInferError(
            f"A KV budget of {budget} bytes ({source}) holds no KV page of "
            f"{per_page} bytes for this model; raise --memory-budget.")
    full = math.ceil((context_length or _FALLBACK_CONTEXT) / P)
    sizes: dict[int | None, int] = {}
    for w in keys:
        if w is not None:
            hold = min(full, math.ceil((w - 1 + DEFAULT_WINDOW_SLACK + config.prefill_step_size) / P) + 1)
            sizes[w] = min(even, config.max_batch * hold + 1)
            budget -= sizes[w] * windows.count(w) * layer_page
    if None in keys:
        usable = (2 if config.prefix_cache else 1) * config.max_batch * full + 1
        sizes[None] = min(budget // (windows.count(None) * layer_page), usable)
    return [sizes[w] for w in keys]


def pool_growth(config: EngineConfig) -> PoolGrowth | None:
    """The growth policy of the engine's store: ``grow_pool``'s own, else the default one
    (:data:`~mlx_infer.defaults.KV_GROWTH_HEADROOM`, :data:`~mlx_infer.defaults.KV_GROWTH_GRANULE`);
    ``None`` when ``grow_pool`` is off."""
    grow = config.grow_pool
    if isinstance(grow, PoolGrowth):
        return grow
    if grow is None:
        grow = defaults.GROW_KV_POOL["gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"]
    return PoolGrowth() if grow else None


def initial_pages(sizes: list[int], growth: PoolGrowth | None) -> list[int] | None:
    """Pages each group materializes at start (``None``: all of ``sizes``, no growth).

    One growth granule (:meth:`PoolGrowth.initial`: 16 pages by default, 256 tokens at the
    default page size, mlx-lm's KV cache step), at most the group's capacity: an idle engine
    holds about what mlx-lm's cache holds for one short request. The scheduler grows the
    storage once per admission for what the admitted prompts need, before the step that
    starts them, so a burst does not grow step by step.
    """
    if growth is None:
        return None
    return [growth.initial(cap) for cap in sizes]
