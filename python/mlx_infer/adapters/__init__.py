"""LoRA / DoRA adapters (issue 21).

- :mod:`.formats`: mlx-lm and PEFT adapter directories, validated against the base model;
- :mod:`.bank`: the resident adapters of a model, stacked per target (LRU, capacity, bytes);
- :mod:`.apply`: the update inside the eager graph, per row (:func:`adapter_rows`);
- :mod:`.native`: the bank as inputs of the compiled C++ steps (``cpp/include/mlx_infer/lora.h``);
- :mod:`.select`: picking an adapter for a generation; :mod:`.fuse`: ``mlx-infer fuse``.

Rows with different adapters, or none, run in one forward, eager or compiled: nothing about
an adapter is baked into a traced graph, so the compiled steps stay on with adapters.
"""

from .apply import adapter_rows, current_selection
from .bank import (AdapterBank, AdapterInUseError, AdapterMemoryError, AdapterNotFoundError, AdapterSlotsBusyError,
                   bank_of, ensure_bank)
from .formats import Adapter, AdapterError, LoraTarget, load_adapter
from .select import attach_adapter, selected

__all__ = [
    "Adapter", "AdapterBank", "AdapterError", "AdapterInUseError", "AdapterMemoryError", "AdapterNotFoundError",
    "AdapterSlotsBusyError",
    "LoraTarget",
    "adapter_rows", "attach_adapter", "bank_of", "current_selection", "ensure_bank", "load_adapter", "selected",
]
