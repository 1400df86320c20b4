"""LoRA / DoRA adapters: loading (formats), the resident bank (bank) and the update (apply).

Rows with different adapters, or none, run in one forward: the eager graph reads each row's
bank slot from :func:`adapter_rows`; the compiled C++ steps take the bank's stacked tensors
and the per-row slots as inputs (``cpp/include/mlx_infer/lora.h``), so the compiled step
stays on with adapters. See ``docs`` in each module.
"""

from .apply import adapter_rows, current_selection
from .bank import AdapterBank, AdapterInUseError, AdapterNotFoundError, bank_of, ensure_bank
from .formats import Adapter, AdapterError, LoraTarget, load_adapter
from .select import attach_adapter, selected

__all__ = [
    "Adapter", "AdapterBank", "AdapterError", "AdapterInUseError", "AdapterNotFoundError", "LoraTarget",
    "adapter_rows", "attach_adapter", "bank_of", "current_selection", "ensure_bank", "load_adapter", "selected",
]
