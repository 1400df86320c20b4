"""Every model variant through every path: the same greedy tokens.

Variants (:data:`VARIANTS`): every family and every config switch the loader
reads — llama with default / llama3 / yarn / linear / traditional RoPE, tied
and untied heads, attention and MLP biases; mistral (every layer sliding);
qwen2 (q/k/v bias; and sliding from layer 1 on); qwen3 (q/k norms); gemma3
(and with linear RoPE scaling on its global layers); gemma4 dense, MoE,
KV-shared and per-layer inputs — in float32, and a spread of them in bfloat16 and 4- and 8-bit weights (quantized by
:func:`mlx_infer.artifacts.convert.convert`, as ``mlx-infer convert`` does).
Each is a tiny random model directory (tests/tiny.py) loaded by the loader,
with its linear layers on MLX's stock kernels and (on a CPU) on mlx-infer's CPU
kernels, the CPU default (:data:`KERNELS`).

Paths (:data:`PATHS`), each on a fresh load of the directory (so nothing a
previous path evaluated can hide a lazy array, see ``test_graph_constants_*``):

- ``eager``     ``generate_tokens`` on the eager graph: the reference;
- ``compiled``  ``generate_tokens`` with the binding's compiled C++ decode step;
- ``engine``    ``Engine`` (paged KV, compiled paged step), two requests batched;
- ``server``    one ``/v1/completions`` request through uvicorn on 127.0.0.1.

Oracle: the eager tokens, exactly (greedy, EOS ignored, :data:`N` tokens). The
server returns text: it must equal the reference tokens' text as the engine's
streaming detokenizer renders it. No cell is refused today (Gemma 4, once
refused by the paged step, runs it): every cell asserts that its compiled step
ran, so a refusal or a silent fallback fails the cell.
"""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_infer.artifacts.convert import convert
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.bindings.autoregressive import bind_autoregressive
from mlx_infer.models import (SUPPORTED_MODEL_TYPES, family_of, get_model_classes, graph_constants,
                              materialize_graph_constants)
from mlx_infer.state.kv import RotatingKVCache
from mlx_infer.state.paged.store import model_geometry
from http_helpers import completion_text, rendered_text
from tiny import CONFIGS, GEMMA4_SWITCHES, make_tiny_model_dir

N = 10  # greedy tokens per request
PROMPT = [5, 17, 33, 2, 100, 7, 9, 11, 40, 41, 42, 43]  # 12 tokens > the sliding window of 8
PROMPT_2 = PROMPT[3:12]  # a second, shorter row for the engine's batch
PROMPTS = (PROMPT, PROMPT_2)

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"type": "linear", "factor": 2.0}

#: name -> (tiny.py family, config overrides, weights: "f32", "bf16", "q4" or "q8").
VARIANTS: dict[str, tuple[str, dict, str]] = {
    "llama": ("llama", {}, "f32"),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, "f32"),
    "llama-llama3": ("llama", {"rope_scaling": LLAMA3}, "f32"),
    "llama-yarn": ("llama", {"rope_scaling": YARN}, "f32"),
    "llama-linear": ("llama", {"rope_scaling": LINEAR}, "f32"),
    "llama-traditional": ("llama", {"rope_traditional": True}, "f32"),
    "mistral": ("mistral", {}, "f32"),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}, "f32"),
    "qwen2": ("qwen2", {}, "f32"),
    "qwen2-swa": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, "f32"),  # full, then sliding
    "qwen3": ("qwen3", {}, "f32"),
    "gemma3": ("gemma3", {}, "f32"),
    "gemma3-linear": ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "f32"),  # global layers
    **{f"gemma4-{k}": ("gemma4", v, "f32") for k, v in GEMMA4_SWITCHES.items()},
    "llama-llama3-bf16": ("llama", {"rope_scaling": LLAMA3}, "bf16"),
    "gemma3-bf16": ("gemma3", {}, "bf16"),
    "gemma4-ple-bf16": ("gemma4", GEMMA4_SWITCHES["ple"], "bf16"),
    "llama-q4": ("llama", {}, "q4"),
    "llama-yarn-q8": ("llama", {"rope_scaling": YARN}, "q8"),
    "qwen3-q4": ("qwen3", {}, "q4"),
    "mistral-q8": ("mistral", {}, "q8"),
    "gemma3-q4": ("gemma3", {}, "q4"),
    "gemma4-moe-q4": ("gemma4", GEMMA4_SWITCHES["moe"], "q4"),
    "gemma4-kv_shared-q8": ("gemma4", GEMMA4_SWITCHES["kv_shared"], "q8"),
}
PATHS = ("compiled", "engine", "server")
F32 = [v for v, (_, _, w) in VARIANTS.items() if w == "f32"]
#: Linear layers on MLX's kernels, and on mlx-infer's CPU kernels where MLX runs on the CPU.
KERNELS = ("stock", "cpu") if mx.default_device() == mx.cpu else ("stock",)


#: tiny.py weight spread per family: the gemmas' tied, sqrt(hidden)-scaled embeddings otherwise
#: make a random model echo one token, and a constant stream would hide a diverging path.
SPREAD = {"gemma3": {"vector_noise": True, "embed_scale": 0.5}, "gemma4": {"vector_noise": True, "embed_scale": 0.5}}
MIN_DISTINCT = 6  # distinct tokens over the reference streams of PROMPTS

_DIRS: dict[tuple[Path, str], Path] = {}
_REFERENCE: dict[tuple[str, str], list[list[int]]] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("matrix")


def model_dir(root: Path, variant: str) -> Path:
    """The variant's model directory (written once per test module)."""
    if (root, variant) not in _DIRS:
        family, overrides, weights = VARIANTS[variant]
        dtype = mx.bfloat16 if weights == "bf16" else mx.float32
        path = make_tiny_model_dir(root / f"{variant}-src", family, dtype=dtype, **SPREAD.get(family, {}),
                                   **overrides)
        if weights in ("q4", "q8"):
            path = convert(path, root / variant, quantize_bits=int(weights[1]), group_size=32, progress=False)
        _DIRS[root, variant] = path
    return _DIRS[root, variant]


def fresh(root: Path, variant: str, kernels: str = "stock"):
    """A new load of the variant (no array evaluated by an earlier path) on MLX's stock
    kernels or on mlx-infer's CPU kernels (the default on a CPU, off in the rest of the suite)."""
    return load_model(model_dir(root, variant), cpu_kernels=kernels == "cpu")


def eager_tokens(loaded, prompt: list[int], decode=None) -> list[int]:
    return [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=N, decode=decode)]


def reference(root: Path, variant: str, kernels: str) -> list[list[int]]:
    """The eager graph's greedy tokens for each of :data:`PROMPTS`."""
    if (variant, kernels) not in _REFERENCE:
        loaded = fresh(root, variant, kernels)
        streams = [eager_tokens(loaded, p) for p in PROMPTS]
        assert len(set().union(*streams)) >= MIN_DISTINCT, f"a near-constant reference hides nothing: {streams}"
        _REFERENCE[variant, kernels] = streams
    return _REFERENCE[variant, kernels]


def requests() -> list[EngineRequest]:
    return [EngineRequest(prompt_ids=p, max_tokens=N, ignore_eos=True, detokenize=False) for p in PROMPTS]


def check_paged_step(engine: Engine) -> None:
    """The compiled paged step ran the decode steps: no refusal, no silent fallback."""
    step = engine.paged_decode
    assert step is not None, engine.paged_decode_reason
    assert not step.failed, step.last_error
    assert step.eager_steps <= 1  # the first step allocates the pages' storage eagerly


# -- the matrix ---------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_same_greedy_tokens(root, variant, kernels, path):
    """One cell: ``path`` on ``variant`` gives the eager graph's greedy tokens."""
    want = reference(root, variant, kernels)
    loaded = fresh(root, variant, kernels)
    if path == "compiled":
        binding = bind_autoregressive(loaded)
        step = binding.create_decode()
        assert step is not None, binding.decode_unavailable_reason()
        native, calls, step_fn = step.native, [], step.step
        step.step = lambda *a: calls.append(1) or step_fn(*a)  # count the steps the loop hands it
        assert eager_tokens(loaded, PROMPT, decode=step) == want[0]
        assert not step.failed, step.last_error  # so each of them ran the C++ step
        assert len(calls) == N - 1 and native.traces >= 1
    elif path == "engine":
        with Engine(loaded, EngineConfig(page_size=4)) as engine:
            results = engine.generate(requests(), timeout=120)
            assert [r.error for r in results] == [None, None]
            assert [r.token_ids for r in results] == want
            check_paged_step(engine)
    else:
        engine = Engine(loaded, EngineConfig(page_size=4)).start()
        try:
            text = completion_text(engine, PROMPT, N)
        finally:
            engine.stop()
        assert text == rendered_text(loaded, want[0])
        check_paged_step(engine)


def test_matrix_covers_every_family_and_switch():
    """Each autoregressive graph family, tiny config, Gemma 4 switch, RoPE type and weight format has a row."""
    families = {f for f, _, _ in VARIANTS.values()}
    assert families == set(CONFIGS)
    served = {family_of(CONFIGS[f]["model_type"]) for f in families}
    # The eager-only families of issue 20 run every path in tests/test_families_paths.py.
    from families import SPECS
    served |= {family_of(spec.make_config().model_type) for spec in SPECS.values()}
    for model_type in SUPPORTED_MODEL_TYPES:  # a new family must join the matrix (denoising graphs have no paths here)
        if get_model_classes(model_type)[0].declaration.method == "autoregressive":
            assert family_of(model_type) in served, model_type
    assert {name.removeprefix("gemma4-") for name in VARIANTS if name.startswith("gemma4-")} >= set(GEMMA4_SWITCHES)
    ropes = {(o.get("rope_scaling") or {}).get("rope_type") or (o.get("rope_scaling") or {}).get("type")
             for f, o, _ in VARIANTS.values() if f == "llama"}
    assert ropes == {None, "llama3", "yarn", "linear"}
    assert any(o.get("rope_traditional") for f, o, _ in VARIANTS.values() if f == "llama")
    assert {w for _, _, w in VARIANTS.values()} == {"f32", "bf16", "q4", "q8"}


# -- constants are materialized at load ------------------------------------------------


def _in_thread(fn) -> BaseException | None:
    """Run ``fn`` on a new thread (its own MLX streams); the exception it raised, or None."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out[0] = e
        finally:
            mx.clear_streams()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


@pytest.mark.parametrize("variant", F32)
def test_graph_constants_are_materialized_at_load(root, variant):
    """After load, another thread can evaluate every non-parameter array and run a whole forward."""
    loaded = fresh(root, variant)
    model = loaded.model
    constants = graph_constants(model)
    family, overrides, _ = VARIANTS[variant]
    if family == "gemma4" or (overrides.get("rope_scaling") or {}).get("rope_type") in ("llama3", "yarn"):
        assert constants, "the RoPE frequency tables are arrays the walk must find"

    def forward() -> None:
        mx.eval(constants)
        mx.eval(model(mx.array([PROMPT]), cache=model.make_cache()))

    assert _in_thread(forward) is None


def test_lazy_constants_fail_on_another_thread_until_materialized():
    """The bug the loader prevents: a graph built here, run on another thread, fails until materialized."""
    model_cls, args_cls = get_model_classes("llama")
    model = model_cls(args_cls.from_dict({**CONFIGS["llama"], "rope_scaling": LLAMA3}))
    mx.eval(model.parameters())
    tokens = mx.array([PROMPT])

    def forward() -> None:
        mx.eval(model(tokens))

    err = _in_thread(forward)
    assert err is not None and "Stream" in str(err)
    materialize_graph_constants(model)
    assert _in_thread(forward) is None


@pytest.mark.parametrize("variant", F32)
def test_paged_windows_follow_the_layers(root, variant):
    """The paged store has one layer per KV-owning layer, windowed exactly where the layer slides."""
    family = VARIANTS[variant][0]
    model = fresh(root, variant).model
    windows, _, _ = model_geometry(model)
    donors = getattr(model.args, "kv_donors", None) or [None] * len(model.layers)
    owners = [layer for layer, donor in zip(model.layers, donors) if donor is None]
    caches = model.make_cache()
    assert len(windows) == len(owners) == len(caches)
    for window, layer, cache in zip(windows, owners, caches):
        assert (window is not None) == layer.use_sliding == isinstance(cache, RotatingKVCache)
        assert window in (None, model.args.sliding_window)
    assert any(w is not None for w in windows) == (family in ("mistral", "gemma3", "gemma4")
                                                    or variant == "qwen2-swa")
