"""Adapters over HTTP: listed as models, chosen per request, loaded and unloaded at run time.

vLLM's conventions: each adapter is a model in ``/v1/models`` (``parent``: the base model)
and a request picks it by ``"model": NAME``; an ``"adapter": NAME`` field does the same
with the base model's id. Run time::

    GET    /v1/adapters                 the registered adapters (name, path, resident, in use)
    POST   /v1/adapters                 {"name": ..., "path": ...}: load and validate; 400 on a bad
                                        adapter (the server keeps serving), 409 on a taken name,
                                        413 when the bank would outgrow the memory budget
    DELETE /v1/adapters/{name}          unload; 404 unknown, 409 while a request uses it
    POST   /v1/load_lora_adapter        vLLM's {"lora_name", "lora_path"}
    POST   /v1/unload_lora_adapter      vLLM's {"lora_name"}

Loading reads and checks the files on a worker thread; the bank's own lock orders it with
the engine thread's use (engine/adapters.py). The bank lives with the engine: every function here
that reads or changes it runs through ``engine.call`` (in the engine's process when the server runs
the engine in its own, engine/process.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from ..adapters import (AdapterBank, AdapterError, AdapterInUseError, AdapterMemoryError, AdapterNotFoundError,
                        bank_of)
from ..errors import MlxInferError
from . import protocol as P


class LoadAdapter(BaseModel):
    model_config = P._STRICT

    name: str
    path: str


class VllmLoad(BaseModel):
    model_config = P._STRICT

    lora_name: str
    lora_path: str


class VllmUnload(BaseModel):
    model_config = P._STRICT

    lora_name: str


def adapter_of(engine: Any, req: Any, model_names: set[str]) -> str | None:
    """The adapter a request asks for (``model`` naming an adapter, or its ``adapter`` field).

    Raises:
        OpenAIError: 404 for an adapter nobody loaded.
    """
    field = getattr(req, "adapter", None)
    if field is None and req.model in model_names:
        return None  # the base model: no question to the engine
    names = adapter_names(engine)
    if field is not None:
        if field not in names:
            raise P.OpenAIError(404, f"The adapter '{field}' is not loaded (loaded: {', '.join(sorted(names)) or 'none'}).",
                                param="adapter", code="model_not_found")
        return field
    return req.model if req.model in names else None


def adapter_models(engine: Any, model_id: str, created: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the registered adapters (vLLM's shape)."""
    return [{"id": n, "object": "model", "created": created, "owned_by": "mlx-infer", "root": p,
             "parent": model_id, "max_model_len": engine.context_length} for n, p in engine.call(_sources)]


# -- run in the engine's process (EngineProcess.call; Engine.call in process) -------------


def _sources(engine: Any) -> list[tuple[str, str]]:
    bank = bank_of(engine.model)
    return [] if bank is None else [(n, str(p)) for n, p in bank.sources.items()]


def _names(engine: Any) -> set[str]:
    bank = bank_of(engine.model)
    return set(bank.names) if bank is not None else set()


def _listing(engine: Any) -> list[dict[str, Any]]:
    b = bank_of(engine.model)
    return [] if b is None else [{"name": n, "path": str(p), "resident": n in b.resident, "in_use": b.in_use(n)}
                                 for n, p in b.sources.items()]


def _bank(engine: Any) -> AdapterBank:
    b = bank_of(engine.model)
    return b if b is not None else AdapterBank(engine.model)


def _register(engine: Any, name: str, path: str) -> dict[str, Any]:
    b = _bank(engine)
    adapter = b.register(name, path, max_nbytes=bank_allowance(engine, b))
    return {"name": adapter.name, "path": str(adapter.path), "format": adapter.format, "kind": adapter.kind,
            "rank": adapter.rank, "targets": len(adapter.targets)}


def _unload(engine: Any, name: str) -> None:
    _bank(engine).unload(name)


def bank_allowance(engine: Any, bank: AdapterBank) -> int | None:
    """Most bytes the adapter bank may grow to at run time: what it holds now plus what the memory
    budget (engine/config.py's ``kv_budget``, read again now) leaves beside the KV pool the engine
    allocated. ``None`` when the pool was sized by page count (``num_pages``), not by a budget."""
    if getattr(engine, "kv_budget", None) is None:
        return None
    from ..engine.config import kv_budget

    try:
        free = kv_budget(engine.model, engine.config).bytes - pool_bytes(engine)
    except MlxInferError:  # the budget is already spent
        free = 0
    return bank.nbytes + max(0, free)


def pool_bytes(engine: Any) -> int:
    """Bytes of the engine's KV pool once every layer's storage exists (it is allocated on first use)."""
    from ..engine.config import kv_page_bytes
    from ..state.paged.store import model_geometry

    store = engine.store
    windows = model_geometry(engine.model)[0]
    layer_page = kv_page_bytes(engine.model, store.page_size, engine.config.kv_dtype) // len(windows)
    return max(store.nbytes, sum(g.num_pages * layer_page * len(g.layers) for g in store.groups))


# -- the routes ------------------------------------------------------------------------


def add_adapter_routes(app: FastAPI, engine: Any, reserved: set[str]) -> None:
    """Register the run-time adapter routes (see the module doc). ``reserved``: the base model's names."""

    async def load(name: str, path: str) -> dict[str, Any]:
        if not name or name in reserved:
            raise P.OpenAIError(400, f"'{name}' cannot name an adapter: it is empty or the base model's id.",
                                param="name", code="invalid_value")
        try:
            return await asyncio.to_thread(engine.call, _register, name, path)
        except AdapterInUseError as e:
            raise P.OpenAIError(409, str(e), code="adapters_busy") from None
        except AdapterMemoryError as e:
            raise P.OpenAIError(413, str(e), param="path", code="adapter_too_large") from None
        except AdapterError as e:
            status, code = (409, "adapter_exists") if "already loaded" in str(e) else (400, "invalid_adapter")
            raise P.OpenAIError(status, str(e), param="path" if status == 400 else "name", code=code) from None
        except (OSError, ValueError, RuntimeError) as e:  # a path the OS refuses: the client's input
            raise P.OpenAIError(400, f"cannot load an adapter from {path!r}: {e}", param="path",
                                code="invalid_adapter") from None

    async def unload(name: str) -> dict[str, Any]:
        try:
            await asyncio.to_thread(engine.call, _unload, name)
        except AdapterNotFoundError as e:
            raise P.OpenAIError(404, str(e), param="name", code="adapter_not_found") from None
        except AdapterInUseError as e:
            raise P.OpenAIError(409, str(e), param="name", code="adapter_in_use") from None
        return {"name": name, "unloaded": True}

    @app.get("/v1/adapters")
    async def list_adapters() -> dict[str, Any]:
        return {"object": "list", "data": engine.call(_listing)}

    @app.post("/v1/adapters")
    async def post_adapter(req: LoadAdapter) -> dict[str, Any]:
        return await load(req.name, req.path)

    @app.delete("/v1/adapters/{name}")
    async def delete_adapter(name: str) -> dict[str, Any]:
        return await unload(name)

    @app.post("/v1/load_lora_adapter")
    async def vllm_load(req: VllmLoad) -> dict[str, Any]:
        return await load(req.lora_name, req.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def vllm_unload(req: VllmUnload) -> dict[str, Any]:
        return await unload(req.lora_name)


def adapter_names(engine: Any) -> set[str]:
    """Names of the registered adapters (valid ``model`` values besides the base model's)."""
    return engine.call(_names)


def served_name(engine: Any, req: Any, model_names: set[str], model_id: str) -> str:
    """The ``model`` a response names: the adapter serving it (vLLM's convention), else the model's id."""
    name = adapter_of(engine, req, model_names)
    return name if name is not None else model_id
