"""The KV pool sized from the device (EngineConfig.memory_budget_gb=None), with the device's
memory faked: a GPU's recommended working set / total memory / free memory, MLX's active and
cache memory (what this process holds), the CPU's available RAM."""

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


def fake_gpu(monkeypatch, info, active=0, cache=0):
    monkeypatch.setattr(mx, "default_device", lambda: SimpleNamespace(type=mx.DeviceType.gpu))
    monkeypatch.setattr(mx, "device_info", lambda *a: info)
    monkeypatch.setattr(mx, "get_active_memory", lambda: active)
    monkeypatch.setattr(mx, "get_cache_memory", lambda: cache)


def test_gpu_pool_is_the_fraction_of_the_working_set_minus_what_the_process_holds(tiny, monkeypatch):
    # 2 GiB active: our weights and another model's (mlx-lm's, in served.py) already loaded.
    fake_gpu(monkeypatch, {"max_recommended_working_set_size": 8 * GiB, "memory_size": 16 * GiB}, active=2 * GiB)
    reserve = cfg.activation_reserve(tiny.model, EngineConfig())
    budget = cfg.kv_budget(tiny.model, EngineConfig())
    assert budget.bytes == int(8 * GiB * 0.8) - 2 * GiB - reserve
    assert "recommended working set" in budget.source and "held by this process 2.0 GiB" in budget.source
    assert "other processes" not in budget.source  # Metal reports no free memory
    half = cfg.kv_budget(tiny.model, EngineConfig(memory_fraction=0.5))
    assert half.bytes == int(8 * GiB * 0.5) - 2 * GiB - reserve
    per_page = cfg.kv_page_bytes(tiny.model, 16)
    assert cfg.pool_pages(tiny.model, EngineConfig(), 1 << 20, budget) == [budget.bytes // per_page]


def test_weights_count_even_before_they_are_materialized(tiny, monkeypatch):
    fake_gpu(monkeypatch, {"total_memory": 4 * GiB}, active=0)
    budget = cfg.kv_budget(tiny.model, EngineConfig())
    assert budget.bytes == (int(4 * GiB * 0.8) - cfg.weight_bytes(tiny.model)
                            - cfg.activation_reserve(tiny.model, EngineConfig()))


def test_cuda_subtracts_what_other_processes_hold(tiny, monkeypatch):
    """H200, session 3: a server started beside a benchmark process holding a 123 GiB pool took
    another 123 GiB. Now the memory others hold (total - free - ours) comes off."""
    info = {"total_memory": 140 * GiB, "free_memory": 135 * GiB}  # we hold 4 active + 1 cached
    fake_gpu(monkeypatch, info, active=4 * GiB, cache=GiB)
    reserve = cfg.activation_reserve(tiny.model, EngineConfig())
    alone = cfg.kv_budget(tiny.model, EngineConfig())
    assert alone.bytes == int(140 * GiB * 0.8) - 4 * GiB - reserve
    assert "total memory" in alone.source and "held by other processes 0.0 GiB" in alone.source
    info["free_memory"] = 10 * GiB  # another process took 125 GiB: nothing left under 0.8
    with pytest.raises(MlxInferError, match="held by other processes 125.0 GiB.*<= 0"):
        cfg.kv_budget(tiny.model, EngineConfig())
    info["free_memory"] = 75 * GiB  # another process took 60 GiB
    shared = cfg.kv_budget(tiny.model, EngineConfig())
    assert shared.bytes == int(140 * GiB * 0.8) - 4 * GiB - 60 * GiB - reserve
    assert "held by other processes 60.0 GiB" in shared.source


def test_activation_reserve_scales_with_batch_and_chunk(tiny):
    small = cfg.activation_reserve(tiny.model, EngineConfig())
    assert small == cfg.ACTIVATION_RESERVE_BYTES  # a tiny model: the 1 GiB floor binds
    hidden, intermediate, vocab = cfg.model_sizes(tiny.model)
    assert hidden > 0 and intermediate > 0 and vocab > 0
    config = EngineConfig(max_batch=1 << 16, prefill_step_size=1 << 20)
    want = cfg.ACTIVATION_SAFETY * (((1 << 16) + (1 << 20)) * (3 * hidden + 2 * intermediate)
                                    * cfg.model_dtype(tiny.model).size + ((1 << 16) + 1) * vocab * 8)
    assert want > cfg.ACTIVATION_RESERVE_BYTES
    assert cfg.activation_reserve(tiny.model, config) == want


def test_pool_is_capped_at_what_the_engine_can_use(tiny):
    per_page = cfg.kv_page_bytes(tiny.model, 16)
    big = cfg.KVBudget(per_page * 10_000, "test")
    config = EngineConfig(max_batch=4, page_size=16)
    # 4 sequences of a 256-token context: 16 pages each, as many again for cached prefixes.
    assert cfg.pool_pages(tiny.model, config, 256, big) == [2 * 4 * 16 + 1]
    no_cache = EngineConfig(max_batch=4, page_size=16, prefix_cache=False)
    assert cfg.pool_pages(tiny.model, no_cache, 256, big) == [4 * 16 + 1]


def test_cpu_pool_is_the_fraction_of_available_ram(tiny, monkeypatch):
    monkeypatch.setattr(cfg, "available_ram", lambda: 12 * GiB)
    budget = cfg.kv_budget(tiny.model, EngineConfig())
    # Available RAM already excludes what this process holds: nothing more comes off.
    assert budget.bytes == 3 * GiB - cfg.ACTIVATION_RESERVE_BYTES and "available RAM" in budget.source
    assert "held by" not in budget.source


def test_an_explicit_budget_overrides_the_device(tiny, monkeypatch):
    fake_gpu(monkeypatch, {"total_memory": 141 * GiB})
    budget = cfg.kv_budget(tiny.model, EngineConfig(memory_budget_gb=2.0))
    assert budget.bytes == int(2 * GiB * cfg.KV_FRACTION) and "--memory-budget 2 GB" in budget.source


def test_a_device_too_small_is_a_clear_error(tiny, monkeypatch):
    fake_gpu(monkeypatch, {"total_memory": GiB})
    with pytest.raises(MlxInferError, match="no memory for KV pages.*--memory-budget"):
        cfg.kv_budget(tiny.model, EngineConfig())
    # A big enough device that this process (another model loaded beside) already fills.
    fake_gpu(monkeypatch, {"total_memory": 16 * GiB}, active=14 * GiB)
    with pytest.raises(MlxInferError, match="held by this process 14.0 GiB.*no memory for KV pages|"
                                            "no memory for KV pages.*held by this process 14.0 GiB"):
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
