"""LoRA / DoRA adapters (issue 21): loading, validation and the eager update vs mlx-lm.

Oracle: mlx-lm 0.32.2's own adapter layers (``mlx_lm.tuner.utils.load_adapters``) on
mlx-lm's model of the same tiny directory. Where our graph runs the same MLX ops (stock
kernels, one adapter on every row: mlx-lm's ``(x @ a) @ b`` and DoRA formula), logits are
bit-identical (``mx.array_equal``). The per-row path (a ``(B,)`` slot vector, gather_mm over
the bank's rank-padded stacks) runs other kernels: its logits are held to 1e-4 relative of
mlx-lm's and its greedy tokens must be equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from lora_helpers import make_mlx_adapter, mlx_lm_with_adapter
from tiny import make_tiny_model_dir

from mlx_infer.adapters import (AdapterBank, AdapterError, AdapterInUseError, adapter_rows, attach_adapter,
                                bank_of, load_adapter)
from mlx_infer.artifacts.convert import convert
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import generate_tokens

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "gemma4"]
IDS = mx.array([[5, 17, 33, 2, 90, 41, 7, 12]])
SPREAD = {"gemma3": {"vector_noise": True, "embed_scale": 0.5}, "gemma4": {"vector_noise": True, "embed_scale": 0.5}}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


_DIRS: dict = {}


def model_dir(root: Path, family: str, weights: str = "f32") -> Path:
    key = (root, family, weights)
    if key not in _DIRS:
        path = make_tiny_model_dir(root / f"{family}-src", family, **SPREAD.get(family, {}))
        if weights == "q4":
            path = convert(path, root / f"{family}-q4", quantize_bits=4, group_size=32, progress=False)
        _DIRS[key] = path
    return _DIRS[key]


def ours_with(model_path: Path, adapter: Path):
    loaded = load_model(model_path, cpu_kernels=False)
    name = attach_adapter(loaded.model, adapter)
    return loaded, name


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_bit_identical_to_mlx_lm(root, family):
    d = model_dir(root, family)
    a = make_mlx_adapter(d, root / f"{family}-lora", seed=1)
    theirs = mlx_lm_with_adapter(d, a)
    loaded, name = ours_with(d, a)
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ours = loaded.model(IDS)
    ref = theirs(IDS)
    assert mx.array_equal(ours, ref), f"{family}: max diff {mx.abs(ours - ref).max().item()}"
    base = loaded.model(IDS)  # no selection, no default: the base model
    assert not mx.allclose(base, ref, atol=1e-3), "the adapter changed nothing: the test would hide a no-op"


@pytest.mark.parametrize("kind", ["dora", "q4-lora", "q4-dora"])
def test_dora_and_quantized_base_bit_identical_to_mlx_lm(root, kind):
    d = model_dir(root, "llama", "q4" if kind.startswith("q4") else "f32")
    a = make_mlx_adapter(d, root / f"llama-{kind}", seed=2, dora=kind.endswith("dora"),
                         keys=["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj"])
    theirs = mlx_lm_with_adapter(d, a)
    loaded, name = ours_with(d, a)
    with adapter_rows(bank_of(loaded.model).acquire(name)):
        ours = loaded.model(IDS)
    ref = theirs(IDS)
    assert mx.array_equal(ours, ref), f"{kind}: max diff {mx.abs(ours - ref).max().item()}"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_per_row_path_matches_mlx_lm_within_tolerance(root, family):
    """Two adapters of different ranks in one bank (rank padding), rows picking each and none."""
    d = model_dir(root, family)
    a1 = make_mlx_adapter(d, root / f"{family}-r4", seed=3, rank=4)
    a2 = make_mlx_adapter(d, root / f"{family}-r12", seed=4, rank=12, keys=["self_attn.k_proj", "mlp.up_proj"])
    loaded = load_model(d, cpu_kernels=False)
    n1, n2 = attach_adapter(loaded.model, a1), attach_adapter(loaded.model, a2)
    bank = bank_of(loaded.model)
    s1, s2 = bank.acquire(n1), bank.acquire(n2)
    x = mx.concatenate([IDS, IDS, IDS])  # (3, L)
    with adapter_rows(mx.array([s1, 0, s2], mx.int32)):
        rows = loaded.model(x)
    refs = [mlx_lm_with_adapter(d, a1)(IDS)[0], loaded.model(IDS)[0], mlx_lm_with_adapter(d, a2)(IDS)[0]]
    for r, ref in enumerate(refs):
        assert mx.allclose(rows[r], ref, rtol=1e-4, atol=1e-4), f"row {r}: {mx.abs(rows[r] - ref).max().item()}"
        assert mx.array_equal(rows[r].argmax(-1), ref.argmax(-1))


def test_load_and_generate_with_adapter(root):
    """``load(path, adapter=)`` applies it to every generation; ``generate(adapter=)`` picks one per call."""
    import mlx_infer
    from mlx_infer.generation.autoregressive import generate

    d = model_dir(root, "llama")
    a = make_mlx_adapter(d, root / "llama-api", seed=5, b_std=1.0)
    theirs = mlx_lm_with_adapter(d, a)
    want, ids = [], [5, 17, 33, 2]
    for _ in range(6):  # mlx-lm's greedy continuation
        want.append(int(theirs(mx.array([ids + want]))[0, -1].argmax().item()))
    loaded = mlx_infer.load(d, adapter=a)
    assert bank_of(loaded.model).default == "llama-api"
    for compiled in (None, "compiled"):
        decode = None
        if compiled:
            from mlx_infer.generation.bindings.autoregressive import bind_autoregressive

            decode = bind_autoregressive(loaded).create_decode()
            assert decode is not None
        got = [t.token for t in generate_tokens(loaded.model, ids, max_tokens=6, decode=decode)]
        assert got == want, compiled
        if decode is not None:
            assert not decode.failed, decode.last_error
    plain = load_model(d)
    base = [t.token for t in generate_tokens(plain.model, ids, max_tokens=6)]
    assert base != want, "the adapter does not change the greedy tokens: the test would hide a no-op"
    text = "".join(t.text for t in generate(plain, "The capital", max_tokens=4, adapter=str(a)))
    text_default = "".join(t.text for t in generate(loaded, "The capital", max_tokens=4))
    assert text == text_default


# -- validation -----------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _weights(path: Path) -> dict:
    return dict(mx.load(str(path / "adapters.safetensors")))


def test_bad_adapters_give_clear_errors(root):
    d = model_dir(root, "llama")
    good = make_mlx_adapter(d, root / "llama-good", seed=6)
    model = load_model(d, cpu_kernels=False).model

    def broken(name: str) -> Path:
        return _copy(good, root / f"bad-{name}")

    cases = {}
    p = broken("shape")
    w = _weights(p)
    w["model.layers.0.self_attn.q_proj.lora_a"] = mx.zeros((63, 4))
    mx.save_safetensors(str(p / "adapters.safetensors"), w)
    cases["shape"] = (p, "do not fit the base layer")

    p = broken("missing")
    w = _weights(p)
    del w["model.layers.1.mlp.down_proj.lora_b"]
    mx.save_safetensors(str(p / "adapters.safetensors"), w)
    cases["missing"] = (p, "lacks lora_b")

    p = broken("rank0")
    cfg = json.loads((p / "adapter_config.json").read_text())
    cfg["lora_parameters"]["rank"] = 0
    (p / "adapter_config.json").write_text(json.dumps(cfg))
    cases["rank0"] = (p, "rank must be an integer in [1")

    p = broken("target")
    w = _weights(p)
    w["model.layers.0.self_attn.nope_proj.lora_a"] = mx.zeros((64, 4))
    w["model.layers.0.self_attn.nope_proj.lora_b"] = mx.zeros((4, 64))
    mx.save_safetensors(str(p / "adapters.safetensors"), w)
    cases["target"] = (p, "which the base model does not have")

    p = broken("truncated")
    raw = (p / "adapters.safetensors").read_bytes()
    (p / "adapters.safetensors").write_bytes(raw[: len(raw) // 2])
    cases["truncated"] = (p, "truncated")

    p = broken("noconfig")
    (p / "adapter_config.json").unlink()
    cases["noconfig"] = (p, "has no adapter_config.json")

    for name, (path, message) in cases.items():
        with pytest.raises(AdapterError, match=message.replace("[", r"\[")):
            load_adapter(path, model)
    bank = AdapterBank(model)
    with pytest.raises(AdapterError):
        bank.register("x", cases["shape"][0])
    assert bank.names == [] and bank.stacks == {}  # a refused adapter leaves the bank as it was
    bank.register("good", good)
    assert bank.resident == ["good"]


def test_lru_capacity_and_in_use(root):
    d = model_dir(root, "llama")
    model = load_model(d, cpu_kernels=False).model
    bank = AdapterBank(model, capacity=2)
    paths = [make_mlx_adapter(d, root / f"llama-lru{i}", seed=10 + i) for i in range(3)]
    bank.register("a", paths[0])
    bank.register("b", paths[1])
    shapes = bank.layout
    bank.acquire("a")  # a in use
    bank.register("c", paths[2])  # evicts b (idle, least recently used)
    assert sorted(bank.resident) == ["a", "c"] and bank.names == ["a", "b", "c"]
    assert bank.layout == shapes  # same ranks and targets: same stacked shapes (no retrace)
    with pytest.raises(AdapterInUseError):
        bank.unload("a")
    bank.acquire("c")
    with pytest.raises(AdapterInUseError):
        bank.acquire("b")  # both residents busy: b cannot come back
    bank.release("c")
    assert bank.acquire("b") and sorted(bank.resident) == ["a", "b"]  # reloaded in c's place
    bank.release("a")
    bank.unload("a")
    assert bank.names == ["b", "c"] and bank.nbytes > 0
