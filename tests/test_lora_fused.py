"""Adapters on fused projections (issue 17): where the compiled steps run a layer's q|k|v and
gate|up as one product each (generation/bindings/fused.py), the fused product adds its members'
adapter updates (cpp/decode/lora.cpp), so a model with an adapter bank (``mlx-infer serve``)
decodes fused like any other.

Two forms reach the step: the members' dense updates as one target on the fused linear (rank k r
per slot, B zero on untargeted members' rows: adapters/native.py ``_fused_stack``), and, for DoRA
and a large bank's gathered stacks, per member by name (the step concatenates their updates, zeros
for untargeted members, and adds them once).

Fusion is forced on here (``DecodePolicy(fuse_projections=True)``; the engine's paged step by
making ``None`` resolve as on a GPU). Oracles, per step: the unfused compiled step and the eager
model with the same adapters (teacher-forced on the eager graph's greedy tokens, so one argmax
flip cannot desynchronise the rest): the same argmax, logits within ``LOGITS_ATOL``. Measured
max |fused - eager| (CPU, mlx 0.32.4, float32 tiny models, logits up to ~10): stock kernels
0.0 (llama, qwen3, gemma3, phi3, glm4; LoRA and DoRA; dense and gathered banks; a bfloat16
model; batches of per-row slots too); mlx-infer's CPU kernels <= 1.1e-5, as the unfused step.

phi3 and glm4 fuse projections in their checkpoints (``qkv_proj``, ``gate_up_proj``): an
adapter on such a linear targets it by its own name (``layers.0.qkv``), one linear in the step.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from lora_helpers import make_mlx_adapter
from tiny import make_tiny_model_dir

from mlx_infer.adapters import adapter_rows, attach_adapter, bank_of
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.bindings import graph_spec as spec_module
from mlx_infer.generation.bindings.decode_step import CompiledDecodeStep
from mlx_infer.generation.bindings.graph_spec import DecodePolicy

LOGITS_ATOL = 1e-4  # measured <= 1.1e-5 (see the module doc)
STEPS = 10
PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 12, 99, 4], [61, 3, 8, 150, 22, 9, 14]]
QV = ["self_attn.q_proj", "self_attn.v_proj"]
ALL = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
       "mlp.up_proj", "mlp.down_proj"]
KU = ["self_attn.k_proj", "mlp.up_proj"]  # a member of each fused product, not its first
SPREAD = {"gemma3": {"vector_noise": True, "embed_scale": 0.5}}
FUSED = DecodePolicy(compile_min_batch=1, fuse_projections=True)
UNFUSED = DecodePolicy(compile_min_batch=1, fuse_projections=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora-fused")


def model_dir(root: Path, family: str) -> Path:
    d = root / family
    if not d.exists():
        make_tiny_model_dir(d, family, **SPREAD.get(family, {}))
    return d


def adapter(root: Path, family: str, tag: str, keys: list[str], *, seed: int, rank: int = 4,
            dora: bool = False) -> Path:
    p = root / f"{family}-{tag}"
    if not p.exists():
        make_mlx_adapter(model_dir(root, family), p, seed=seed, rank=rank, keys=keys, dora=dora, b_std=1.0)
    return p


def fused_on_gpu_default(monkeypatch) -> None:
    """``fuse_projections=None`` resolves on, as on a GPU; an explicit value is kept (so a rule that
    turns fusion off for a bank, by setting it False, still turns it off here)."""
    monkeypatch.setattr(spec_module.DecodePolicy, "resolved_fuse_projections",
                        lambda self: True if self.fuse_projections is None else self.fuse_projections)


class Lockstep:
    """Rows decoded side by side by the eager model (each row alone, under its slot), a fused and an
    unfused compiled step (all rows in one batch, per-row slots), fed the eager graph's greedy tokens."""

    def __init__(self, model, prompts: list[list[int]], slots: list[int]):
        self.model = model
        self.eager, firsts = [], []
        paths = {"fused": [], "unfused": []}
        for p, s in zip(prompts, slots):
            for caches in (self.eager, paths["fused"], paths["unfused"]):
                c = model.make_cache()
                with adapter_rows(s):
                    logits = model(mx.array([p]), cache=c)[:, -1]
                caches.append(c)
            firsts.append(int(logits.argmax().item()))
        self.rows = paths
        self.tokens = firsts
        self.steps = {"fused": CompiledDecodeStep(model, policy=FUSED),
                      "unfused": CompiledDecodeStep(model, policy=UNFUSED)}
        assert self.steps["fused"].fused_projections

    def step(self, slots: list[int]) -> None:
        want = []
        for r, (caches, s) in enumerate(zip(self.eager, slots)):
            with adapter_rows(s):
                want.append(self.model(mx.array([[self.tokens[r]]]), cache=caches)[0, -1])
        want = mx.stack(want)  # (B, vocab)
        tokens = mx.array(self.tokens, mx.uint32)
        for kind, step in self.steps.items():
            with adapter_rows(mx.array(slots, mx.int32)):
                got = step.step(tokens, self.rows[kind])
            assert not step.failed, (kind, step.last_error)
            diff = mx.abs(got - want).max().item()
            assert diff <= LOGITS_ATOL, (kind, slots, diff)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), (kind, slots)
        self.tokens = want.argmax(-1).tolist()


def changes_tokens(model, slot: int, prompt: list[int]) -> bool:
    """Whether the adapter in ``slot`` changes the greedy tokens (else the test could hide a no-op)."""
    def run(s):
        c, out, y = model.make_cache(), [], mx.array([prompt])
        for _ in range(STEPS):
            with adapter_rows(s):
                y = model(y, cache=c)[:, -1].argmax(-1, keepdims=True)
            out.append(y.item())
        return out
    return run(slot) != run(0)


CASES = [("llama", "stock", "qv", False), ("llama", "stock", "all", False), ("llama", "cpu", "qv", False),
         ("llama", "cpu", "all", True), ("qwen3", "stock", "all", False), ("gemma3", "stock", "ku", False),
         ("gemma3", "stock", "all", True)]


@pytest.mark.parametrize("family,kernels,keys,dora", CASES,
                         ids=[f"{f}-{k}-{t}{'-dora' if d else ''}" for f, k, t, d in CASES])
def test_fused_step_with_an_adapter_equals_unfused_and_eager(root, family, kernels, keys, dora):
    loaded = load_model(model_dir(root, family), cpu_kernels=kernels == "cpu")
    model = loaded.model
    tag = f"{keys}{'-dora' if dora else ''}"
    name = attach_adapter(model, adapter(root, family, tag, {"qv": QV, "all": ALL, "ku": KU}[keys], seed=11,
                                         dora=dora))
    slot = bank_of(model).acquire(name)
    assert changes_tokens(model, slot, PROMPTS[0])
    run = Lockstep(model, PROMPTS[:1], [slot])
    assert not run.steps["unfused"].fused_projections
    for _ in range(STEPS):
        run.step([slot])
    targets = run.steps["fused"].native.adapter_targets
    members = {"layers.0.q", "layers.0.k", "layers.0.v", "layers.0.gate", "layers.0.up"}
    if dora:  # per member: the step concatenates their updates onto the fused product's rows
        assert members & set(targets) and "layers.0.qkv" not in targets
    else:  # the members' dense updates as one target on the fused linear
        assert "layers.0.qkv" in targets and not members & set(targets)


@pytest.mark.parametrize("keys", ["qv", "all"])
def test_the_fused_step_takes_its_members_updates_by_name_too(root, keys):
    """The step also takes a fused linear's updates by its members' names (what DoRA and gathered
    stacks go by): given the unfused step's inputs (groups: q+v, split and concatenated around k's
    zeros; q+k+v and gate+up, whole), the fused step keeps the unfused step's logits."""
    from mlx_infer.adapters.native import step_inputs

    model = load_model(model_dir(root, "llama"), cpu_kernels=False).model
    name = attach_adapter(model, adapter(root, "llama", keys, {"qv": QV, "all": ALL}[keys], seed=11))
    slot = bank_of(model).acquire(name)
    run = Lockstep(model, PROMPTS[:2], [slot, 0])
    _, unfused_weights, _ = spec_module.graph_spec(model, policy=UNFUSED)
    targets, a, b, scales, g = step_inputs(bank_of(model), unfused_weights)
    assert "layers.0.q+layers.0.v" in targets or "layers.0.q+layers.0.k+layers.0.v" in targets
    run.steps["fused"].native.set_adapters(targets, a, b, scales, g)
    for _ in range(STEPS):
        run.step([slot, 0])
    assert "layers.0.q" in run.steps["fused"].native.adapter_targets


def test_a_large_bank_runs_the_gathered_product_on_fused_members(root):
    """Past DENSE_MAX_COLS (slots x rank) the bank keeps per-slot stacks only: each member's update is
    gather_mm per row, concatenated into the fused product's rows the same way."""
    from mlx_infer.adapters import AdapterBank

    loaded = load_model(model_dir(root, "llama"), cpu_kernels=False)
    model = loaded.model
    bank = AdapterBank(model, capacity=40)
    name = attach_adapter(model, adapter(root, "llama", "qv-r16", QV, seed=61, rank=16))
    assert all(not s.dense for s in bank.stacks.values())
    slot = bank.acquire(name)
    assert changes_tokens(model, slot, PROMPTS[0])
    run = Lockstep(model, PROMPTS[:2], [slot, 0])
    for _ in range(STEPS):
        run.step([slot, 0])


def test_a_bfloat16_model_with_float32_adapters(root):
    """mlx-lm trains float32 adapters for a bfloat16 model: the members' updates run in float32 (as
    ``x @ a`` promotes) and are cast to bfloat16 before the one add."""
    d = root / "llama-bf16"
    if not d.exists():
        make_tiny_model_dir(d, "llama", dtype=mx.bfloat16)
    model = load_model(d, cpu_kernels=False).model
    p = root / "llama-bf16-all"
    if not p.exists():
        make_mlx_adapter(d, p, seed=71, keys=ALL, b_std=1.0)
    name = attach_adapter(model, p)
    slot = bank_of(model).acquire(name)
    assert changes_tokens(model, slot, PROMPTS[0])
    run = Lockstep(model, PROMPTS[:2], [slot, 0])
    for _ in range(STEPS):
        run.step([slot, 0])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_batch_mixing_adapters_and_none_with_hot_load_and_unload(root, family):
    """Rows with different adapters and none share one fused step; adapters loaded (new targets:
    a new trace) and unloaded between steps, down to an empty bank and back."""
    loaded = load_model(model_dir(root, family), cpu_kernels=False)
    model = loaded.model
    a = attach_adapter(model, adapter(root, family, "qv", QV, seed=21), name="a")
    bank = bank_of(model)

    def slot(name: str) -> int:
        s = bank.acquire(name)
        bank.release(name)
        return s

    assert changes_tokens(model, slot(a), PROMPTS[0])
    run = Lockstep(model, PROMPTS, [slot(a), 0, slot(a)])
    for _ in range(3):
        run.step([slot(a), 0, slot(a)])
    traces = run.steps["fused"].traces
    # Hot: the steps see the bank's new version at their next call. New targets and a larger rank:
    # a new layout, traced anew.
    b = attach_adapter(model, adapter(root, family, "all-r8", ALL, seed=22, rank=8), name="b")
    c = attach_adapter(model, adapter(root, family, "ku", KU, seed=23), name="c")
    bank.unload(a)
    assert changes_tokens(model, slot(b), PROMPTS[1]) and changes_tokens(model, slot(c), PROMPTS[0])
    for _ in range(3):
        run.step([slot(c), slot(b), 0])
    assert run.steps["fused"].traces > traces
    bank.unload(b)
    bank.unload(c)
    assert not bank.stacks
    for _ in range(2):
        run.step([0, 0, 0])
    a = attach_adapter(model, adapter(root, family, "qv", QV, seed=21), name="a")
    for _ in range(3):
        run.step([0, slot(a), slot(a)])


def test_a_bank_created_after_the_fused_step_reaches_its_members(root):
    """A server may create the bank after the engine's step (server/adapters.py): the fused step,
    built with no bank, then applies adapters on q/v (they were once left out, unnoticed)."""
    model = load_model(model_dir(root, "llama"), cpu_kernels=False).model
    assert bank_of(model) is None
    run = Lockstep(model, PROMPTS[:2], [0, 0])
    run.step([0, 0])
    name = attach_adapter(model, adapter(root, "llama", "qv", QV, seed=11))
    slot = bank_of(model).acquire(name)
    assert changes_tokens(model, slot, PROMPTS[0])
    for _ in range(STEPS):
        run.step([slot, slot])
    assert "layers.0.qkv" in run.steps["fused"].native.adapter_targets


#: Families whose checkpoints fuse projections themselves, and their adapters' targets: phi3's fused
#: qkv_proj and gate_up_proj are one linear each (targeted by those names); glm4's gate_up_proj too,
#: its q/k/v fused in place by the step (targeted by their members' names).
CHECKPOINT_FUSED = {"phi3": ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"],
                    "glm4": ["self_attn.q_proj", "self_attn.v_proj", "mlp.gate_up_proj", "mlp.down_proj"]}


@pytest.mark.parametrize("family", list(CHECKPOINT_FUSED))
def test_checkpoint_fused_projections_take_adapters(root, family):
    """phi3/glm4 (tests/families.py: written by transformers): adapters on the fused linears the
    checkpoint has run inside the compiled step, fused in place or not, as the eager graph does."""
    from families import build_mlx_lm, hf_setup

    loaded = load_model(hf_setup(family)[0], cpu_kernels=False)
    model = loaded.model
    p = root / f"{family}-checkpoint-fused"
    if not p.exists():
        make_mlx_adapter(None, p, seed=51, keys=CHECKPOINT_FUSED[family], b_std=1.0, model=build_mlx_lm(family)[0])
    name = attach_adapter(model, p)
    bank = bank_of(model)
    slot = bank.acquire(name)
    assert changes_tokens(model, slot, PROMPTS[0])
    run = Lockstep(model, PROMPTS, [slot, 0, slot])
    for _ in range(STEPS):
        run.step([slot, 0, slot])
    assert "layers.0.gate_up" in run.steps["fused"].native.adapter_targets


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_the_engine_fuses_with_a_bank_and_rows_keep_their_tokens(root, monkeypatch, mixed):
    """The paged step (what ``mlx-infer serve`` runs) with a bank: fused where the device default
    says, each request's tokens those it gets alone, before and after a hot swap of adapters;
    ``mixed``: a batch of 4, so later requests' prefill chunks ride in the decode steps."""
    fused_on_gpu_default(monkeypatch)
    loaded = load_model(model_dir(root, "llama"), cpu_kernels=False)
    model = loaded.model
    names = [attach_adapter(model, adapter(root, "llama", "qv", QV, seed=31), name="qv"),
             attach_adapter(model, adapter(root, "llama", "all-dora", ALL, seed=32, dora=True), name="dora")]

    def alone(name, prompt):
        return [t.token for t in generate_tokens(model, prompt, max_tokens=STEPS, adapter=name)]

    def batch(engine, chosen):
        reqs = [EngineRequest(prompt_ids=p, max_tokens=STEPS, ignore_eos=True, detokenize=False, adapter=n)
                for p in PROMPTS for n in chosen]
        out = engine.generate(reqs, timeout=300)
        assert [r.error for r in out] == [None] * len(out)
        assert [r.token_ids for r in out] == [alone(n, p) for p in PROMPTS for n in chosen]

    config = EngineConfig(page_size=4, prefix_cache=False, max_batch=4 if mixed else 32, mixed_steps=mixed,
                          prefill_step_size=4 if mixed else 512)
    with Engine(loaded, config) as engine:
        step = engine.paged_decode
        assert step is not None and step.fused_projections, engine.paged_decode_reason
        batch(engine, names + [None])
        bank_of(model).unload("qv")
        names[0] = attach_adapter(model, adapter(root, "llama", "ku", KU, seed=33), name="ku")
        batch(engine, [None] + names)
        assert not step.failed and step.eager_steps == 0, step.last_error
        assert step.adapters.active  # the adapters ran inside the step, not beside it


def test_a_bank_no_longer_turns_fusion_off(root, monkeypatch):
    """With fusion left to the device default (on, as on a GPU), a model with a bank decodes fused in
    both compiled steps; fails if the rule "bank => unfused" comes back."""
    fused_on_gpu_default(monkeypatch)
    loaded = load_model(model_dir(root, "llama"), cpu_kernels=False)
    attach_adapter(loaded.model, adapter(root, "llama", "qv", QV, seed=41))
    assert CompiledDecodeStep(loaded.model).fused_projections
    with Engine(loaded, EngineConfig(page_size=4)) as engine:
        assert engine.paged_decode is not None and engine.paged_decode.fused_projections


def test_a_target_the_fused_step_does_not_run_is_refused_by_name(root):
    """The step's linears are its members' names; a name it has no linear for is a clear error."""
    loaded = load_model(model_dir(root, "llama"), cpu_kernels=False)
    step = CompiledDecodeStep(loaded.model, policy=FUSED)
    a, b = mx.zeros((8, 64)), mx.zeros((64, 8))  # (S r, in), (out, S r): S = 2, r = 4
    with pytest.raises(ValueError, match="no linear named 'layers.0.qkv_x'"):
        step.native.set_adapters(["layers.0.qkv_x"], [a], [b], [mx.ones((2,))], [None])
    step.native.set_adapters(["layers.0.q"], [a], [b], [mx.ones((2,))], [None])  # a member: accepted
    assert step.native.adapter_targets == ["layers.0.q"]


def test_a_fused_linear_and_its_member_both_targeted_are_refused():
    """phi3's qkv is one linear in the step (targeted as ``layers.0.qkv``); its q as well is an error."""
    from families import hf_setup

    step = CompiledDecodeStep(load_model(hf_setup("phi3")[0], cpu_kernels=False).model, policy=FUSED)
    a, bq, bqkv = mx.zeros((8, 64)), mx.zeros((64, 8)), mx.zeros((128, 8))  # S = 2, r = 4; q 64 rows, qkv 128
    ones = mx.ones((2,))
    with pytest.raises(ValueError, match="'layers.0.qkv' and its member 'layers.0.q' are both targeted"):
        step.native.set_adapters(["layers.0.qkv", "layers.0.q"], [a, a], [bqkv, bq], [ones, ones], [None, None])
