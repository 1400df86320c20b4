"""Defaults live in one module (mlx_infer/defaults.py); every entry point reads them from there."""

from __future__ import annotations

import inspect
import subprocess
import sys

from mlx_infer import api, defaults
from mlx_infer.cli import build_parser
from mlx_infer.engine import EngineConfig, EngineRequest
from mlx_infer.generation import autoregressive
from mlx_infer.server.run import ServeOptions
from mlx_infer.state.paged import PagedKVStore


def _parsed(*argv: str) -> dict:
    return vars(build_parser().parse_args(list(argv)))


def test_the_cli_flags_default_to_the_defaults_module() -> None:
    assert _parsed("generate")["max_tokens"] == defaults.CLI_MAX_TOKENS
    serve = _parsed("serve")
    assert (serve["host"], serve["port"]) == (defaults.HOST, defaults.PORT)
    assert serve["max_tokens"] == defaults.SERVER_MAX_TOKENS
    assert serve["max_batch"] is None and serve["prefill_step_size"] is None  # the device type's, in the engine
    assert (serve["drain_timeout"], serve["header_timeout"], serve["body_timeout"]) == (
        defaults.DRAIN_TIMEOUT_S, defaults.HEADER_TIMEOUT_S, defaults.BODY_TIMEOUT_S)
    assert _parsed("bench")["prefill_step_size"] == defaults.PREFILL_STEP_SIZE


def test_the_api_engine_and_server_default_to_the_defaults_module() -> None:
    c = EngineConfig()
    assert (c.max_batch, c.page_size, c.prefill_step_size, c.max_queue, c.memory_budget_gb) == (
        None, defaults.PAGE_SIZE, None, defaults.MAX_QUEUE, defaults.MEMORY_BUDGET_GB)
    for kind in ("cpu", "gpu"):  # None: the device type's default, filled in by the engine
        d = c.for_device(kind)
        assert (d.max_batch, d.prefill_step_size) == (defaults.MAX_BATCH[kind], defaults.ENGINE_PREFILL_STEP_SIZE[kind])
    assert EngineConfig(max_batch=5, prefill_step_size=7).for_device("gpu").max_batch == 5
    o = ServeOptions()
    assert (o.host, o.port, o.max_batch, o.max_tokens, o.prefill_step_size, o.page_size) == (
        defaults.HOST, defaults.PORT, None, defaults.SERVER_MAX_TOKENS, None, defaults.PAGE_SIZE)
    assert EngineRequest(prompt_ids=[1]).max_tokens == defaults.MAX_TOKENS
    gen = inspect.signature(autoregressive.generate).parameters
    assert gen["max_tokens"].default == defaults.MAX_TOKENS
    assert inspect.signature(api.generate_text).parameters["max_tokens"].default == defaults.MAX_TOKENS
    assert inspect.signature(PagedKVStore).parameters["page_size"].default == defaults.PAGE_SIZE


def test_the_defaults_module_imports_nothing() -> None:
    code = ("import sys; before = set(sys.modules); import importlib.util, pathlib; "
            "import mlx_infer; spec = importlib.util.find_spec('mlx_infer.defaults'); "
            "m = importlib.util.module_from_spec(spec); base = set(sys.modules); spec.loader.exec_module(m); "
            "print(sorted(set(sys.modules) - base))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
