"""The KV pool sized from the device (EngineConfig.memory_budget_gb=None), with the device's
memory faked: a GPU's recommended working set / total memory, the CPU's available RAM."""

from types import SimpleNamespace

import mlx.core as mx
import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, config as cfg
from mlx_infer.errors import MlxInferError

GiB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # A long context, so the pool's cap (2 x max_batch full contexts) is not what binds.
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("mem") / "llama", "llama",
                                          max_position_embeddings=1 << 20))


def fake_gpu(monkeypatch, info):
    monkeypatch.setattr(mx, "default_device", lambda: SimpleNamespace(type=mx.DeviceType.gpu))
    monkeypatch.setattr(mx, "device_info", lambda *a: info)


def test_gpu_pool_is_the_fraction_of_the_working_set_minus_weights_and_reserve(tiny, monkeypatch):
    fake_gpu(monkeypatch, {"max_recommended_working_set_size": 8 * GiB, "memory_size": 16 * GiB})
    budget = cfg.kv_budget(tiny.model, EngineConfig())
    weights = cfg.weight_bytes(tiny.model)
    assert budget.bytes == int(8 * GiB * 0.9) - weights - cfg.ACTIVATION_RESERVE_BYTES
    assert "recommended working set" in budget.source
    half = cfg.kv_budget(tiny.model, EngineConfig(memory_fraction=0.5))
    assert half.bytes == int(8 * GiB * 0.5) - weights - cfg.ACTIVATION_RESERVE_BYTES
    per_page = cfg.kv_page_bytes(tiny.model, 16)
    assert cfg.pool_pages(tiny.model, EngineConfig(), 1 << 20, budget) == [budget.bytes // per_page]


def test_cuda_reports_total_memory(tiny, monkeypatch):
    fake_gpu(monkeypatch, {"total_memory": 141 * GiB, "free_memory": 140 * GiB})
    budget = cfg.kv_budget(tiny.model, EngineConfig())
    assert budget.bytes == int(141 * GiB * 0.9) - cfg.weight_bytes(tiny.model) - cfg.ACTIVATION_RESERVE_BYTES
    assert "total memory" in budget.source


def test_cpu_pool_is_the_fraction_of_available_ram(tiny, monkeypatch):
    monkeypatch.setattr(cfg, "available_ram", lambda: 12 * GiB)
    budget = cfg.kv_budget(tiny.model, EngineConfig())
    assert budget.bytes == 3 * GiB - cfg.ACTIVATION_RESERVE_BYTES and "available RAM" in budget.source


def test_an_explicit_budget_overrides_the_device(tiny, monkeypatch):
    fake_gpu(monkeypatch, {"total_memory": 141 * GiB})
    budget = cfg.kv_budget(tiny.model, EngineConfig(memory_budget_gb=2.0))
    assert budget.bytes == int(2 * GiB * cfg.KV_FRACTION) and "--memory-budget 2 GB" in budget.source


def test_a_device_too_small_is_a_clear_error(tiny, monkeypatch):
    fake_gpu(monkeypatch, {"total_memory": GiB})
    with pytest.raises(MlxInferError, match="no memory for KV pages.*--memory-budget"):
        cfg.kv_budget(tiny.model, EngineConfig())
    with pytest.raises(MlxInferError, match="memory_fraction must be in"):
        EngineConfig(memory_fraction=1.5)


def test_engine_reports_its_sizing(tiny, monkeypatch):
    monkeypatch.setattr(cfg, "available_ram", lambda: 4 * GiB + 128 * 2**20)  # 32 MiB of KV
    engine = Engine(tiny, EngineConfig(page_size=16))
    per_page = cfg.kv_page_bytes(tiny.model, 16)
    assert engine.kv_budget.bytes == 32 * 2**20
    assert engine.store.groups[0].num_pages == 32 * 2**20 // per_page
    from mlx_infer.server.run import _pool_summary

    line = _pool_summary(engine)
    tokens = (engine.store.groups[0].num_pages - 1) * 16
    assert f"{tokens:,} tokens" in line and "available RAM" in line
    engine.stop()
