"""An engine iteration's activations held to the sizing's reserve (engine/activations.py)."""

import gc

import mlx.core as mx
import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer import defaults
from mlx_infer.engine.activations import WINDOW, ActivationCeiling, activation_ceiling, step_row_bytes
from mlx_infer.errors import MlxInferError


@pytest.fixture(autouse=True)
def keep_limit():
    before = mx.set_memory_limit(mx.get_memory_limit())
    yield
    mx.set_memory_limit(before)


def test_engage_sets_resident_plus_reserve_and_release_restores():
    kv = [mx.zeros((1000,), mx.uint8)]  # the KV storage (it grows by allocating)
    mx.eval(kv)
    ceiling = ActivationCeiling(1000, 100, lambda: sum(a.nbytes for a in kv), floor=1)
    reserve = ceiling.reserve(12_000, 20_000)
    assert reserve == 12_000 * 1000 + 20_000 * 100
    assert ceiling.reserve(1, 0) == 1000 and ActivationCeiling(1, 0, lambda: 0).reserve(1, 1) == defaults.CEILING_FLOOR_BYTES
    before = mx.get_memory_limit()
    active = mx.get_active_memory()
    ceiling.engage(12_000, 20_000)
    assert ceiling.engaged
    limit = mx.get_memory_limit()
    # The estimate is the active memory at the start (less the KV storage, then its size added back) + the reserve.
    assert active + reserve - 1 <= limit <= mx.get_active_memory() + reserve + 1
    kv.append(mx.zeros((10_000_000,), mx.uint8))  # the storage grew inside the iteration: re-engaging counts it
    mx.eval(kv)
    ceiling.engage(12_000, 20_000)
    assert mx.get_memory_limit() == pytest.approx(limit + 10_000_000, abs=1_000_000)
    ceiling.release()
    assert not ceiling.engaged and mx.get_memory_limit() == before


def test_resident_estimate_is_the_smallest_start_of_the_window():
    ceiling = ActivationCeiling(1, 0, lambda: 0, floor=1)
    held = [mx.zeros((4_000_000,), mx.uint8)]  # 4 MB in flight at the first start only
    mx.eval(held)
    first = ceiling.ceiling(1, 0)
    del held
    mx.synchronize()  # CUDA returns a freed buffer once the stream that used it is done
    second = ceiling.ceiling(1, 0)  # less active now, but the window's minimum is what counts
    assert second <= first - 3_000_000
    for _ in range(WINDOW + 1):
        ceiling.ceiling(1, 0)
    assert len(ceiling._starts) == WINDOW


def test_a_lower_limit_the_user_set_stays_in_force():
    user = mx.get_active_memory() + 1_000_000
    before = mx.set_memory_limit(user)
    try:
        ceiling = ActivationCeiling(2**30, 0, lambda: 0)
        ceiling.engage(10, 0)
        assert mx.get_memory_limit() == user
        ceiling.release()
        assert mx.get_memory_limit() == user
    finally:
        mx.set_memory_limit(before)


def test_bad_reserve_and_config_are_refused():
    with pytest.raises(ValueError, match="row_bytes and floor must be > 0"):
        ActivationCeiling(0, 0, lambda: 0)
    with pytest.raises(MlxInferError, match="bound_activations"):
        EngineConfig(bound_activations="yes")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("ceiling") / "llama", "llama"))


PROMPTS = [[(7 * i + 3 * j) % 290 + 5 for j in range(240)] for i in range(16)]


def run(loaded, bound: bool, floor: int | None = None) -> tuple[list[list[int]], float, Engine]:
    engine = Engine(loaded, EngineConfig(page_size=4, prefill_step_size=2048, max_batch=16, mixed_steps=True,
                                         bound_activations=bound))
    if floor is not None:  # a tiny model's rows are small: hold its steps to a floor of its own scale
        engine._ceiling = ActivationCeiling(1, 0, lambda: engine.store.nbytes, floor=floor)
    gc.collect()  # earlier tests' arrays freed during the run would make the peak above start meaningless
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    limit = mx.get_memory_limit()
    hs = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=6, detokenize=False, ignore_eos=True)) for p in PROMPTS]
    engine.run_until_idle()
    mx.synchronize()
    assert mx.get_memory_limit() == limit  # restored after every iteration
    return [h.result(1).token_ids for h in hs], (mx.get_peak_memory() - start), engine


def test_a_bounded_engine_peaks_lower_with_the_same_tokens(tiny):
    free, free_peak, e1 = run(tiny, False)
    assert e1._ceiling is None and e1.mixed_steps >= 1
    bounded, bounded_peak, e2 = run(tiny, True, floor=64 * 1024)
    assert e2._ceiling is not None and e2._ceiling.floor == 64 * 1024 and not e2._ceiling.engaged
    assert bounded == free
    # A 2,048-row chunk step of the tiny model holds its activations at once unbounded; bounded, the host waits.
    assert bounded_peak < 0.7 * free_peak, (bounded_peak, free_peak)


def test_the_default_follows_the_device_type(tiny):
    engine = Engine(tiny, EngineConfig(page_size=4))
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    assert (engine._ceiling is not None) == on_gpu
    forced = Engine(tiny, EngineConfig(page_size=4, bound_activations=True))
    ceiling = activation_ceiling(forced)
    hidden, inter = tiny.model.args.hidden_size, tiny.model.args.intermediate_size
    layers = min(tiny.model.args.num_hidden_layers, defaults.CEILING_LAYERS)
    assert ceiling.row_bytes == step_row_bytes(tiny.model) == layers * (8 * hidden + 3 * inter) * 4  # float32 tiny
    assert ceiling.logit_row_bytes == tiny.model.args.vocab_size * (4 + 8)


def test_only_iterations_that_carry_prompt_tokens_engage(tiny):
    engine = Engine(tiny, EngineConfig(page_size=4, prefill_step_size=64, max_batch=8, mixed_steps=True,
                                       bound_activations=True))
    calls = []
    engage = engine._ceiling.engage
    engine._ceiling.engage = lambda rows, logit_rows: (calls.append((rows, logit_rows)), engage(rows, logit_rows))
    hs = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=12, detokenize=False, ignore_eos=True))
          for p in PROMPTS[:3]]  # 3 x 240 tokens (+ 12 within the tiny model's 256-token context)
    engine.run_until_idle()
    assert all(len(h.result(1).token_ids) == 12 for h in hs)
    # One engagement per forward with prompt rows (3 x 240 tokens in 64-token chunks), none for the decode-only steps.
    assert len(calls) == engine.mixed_steps + engine.separate_prefills and 12 <= len(calls) <= 16
    assert all(rows > logit_rows - 1 >= 0 for rows, logit_rows in calls), calls  # prompt rows beyond the logit rows
    assert not engine._ceiling.engaged


def test_the_counted_layers_follow_the_env_knob(tiny, monkeypatch):
    """MLX_INFER_CEILING_LAYERS (read when an engine is built) sets how many layers the reserve counts; a value
    that is not a positive integer is refused with the variable named."""
    hidden, inter = tiny.model.args.hidden_size, tiny.model.args.intermediate_size
    per_layer = (8 * hidden + 3 * inter) * 4  # float32 tiny
    monkeypatch.setenv("MLX_INFER_CEILING_LAYERS", "1")
    assert step_row_bytes(tiny.model) == per_layer
    forced = Engine(tiny, EngineConfig(page_size=4, bound_activations=True))
    assert forced._ceiling is not None and forced._ceiling.row_bytes == per_layer
    monkeypatch.setenv("MLX_INFER_CEILING_LAYERS", "1000")  # at most the model's layers
    assert step_row_bytes(tiny.model) == tiny.model.args.num_hidden_layers * per_layer
    for bad in ("0", "-2", "four", "2.5"):
        monkeypatch.setenv("MLX_INFER_CEILING_LAYERS", bad)
        with pytest.raises(MlxInferError, match=f"MLX_INFER_CEILING_LAYERS must be a positive integer.*{bad!r}"):
            step_row_bytes(tiny.model)
