"""Structured output through the Python API: every constrained output parses and validates.

The schema suite (tests/structured_schemas.py) runs on both tiny random models, sampled at
temperature 1 with several seeds: a random model is the hardest case for the constraint (it
never writes valid JSON on its own), so 100 % validity here is the grammar's doing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.constraints import (Constraint, ConstraintError, ConstraintState, apply_bitmask, bitmask_words,
                                   fill_bitmasks)
from mlx_infer.generation.autoregressive import generate
from mlx_infer.sampling import SamplingParams

from structured_schemas import CHOICES, REAL_SUBSET, REGEXES, SCHEMAS, UNSUPPORTED
from tiny import make_tiny_model_dir

SEEDS = (0, 1, 2)
BUDGET = 200  # tokens; every bounded schema ends well within it (the longest run uses ~100)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param))


def _validator(schema: dict) -> jsonschema.protocols.Validator:
    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _run(loaded, constraint: Constraint, *, seed: int | None = 0, temperature: float = 1.0,
         max_tokens: int = BUDGET, **kw):
    sampling = SamplingParams(temperature=temperature, seed=seed, **kw.pop("sampling", {}))
    with generate(loaded, "Hello", sampling=sampling, max_tokens=max_tokens, constraint=constraint, **kw) as g:
        items = list(g)
    return "".join(t.text for t in items), items, g.stats


def test_suite_is_big_enough():
    assert len(SCHEMAS) >= 50


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_outputs_validate(tiny, name):
    schema = SCHEMAS[name]
    validator = _validator(schema)
    for seed in SEEDS:
        text, _, stats = _run(tiny, Constraint.json_schema(schema), seed=seed)
        assert stats.finish_reason == "stop", (seed, text)
        validator.validate(json.loads(text))


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_match(tiny, pattern):
    for seed in SEEDS:
        text, _, stats = _run(tiny, Constraint.regex(pattern), seed=seed)
        assert re.fullmatch(pattern, text), (seed, text)
        assert stats.finish_reason == "stop"


@pytest.mark.parametrize("choices", CHOICES, ids=lambda c: "|".join(c))
def test_choice_outputs_are_a_choice(tiny, choices):
    seen = set()
    for seed in range(6):
        text, _, _ = _run(tiny, Constraint.choice(choices), seed=seed)
        assert text in choices
        seen.add(text)
    assert len(seen) >= 1


def test_lark_and_gbnf_grammars(tiny):
    lark = 'start: "(" expr ")"\nexpr: NUM (OP NUM){0,3}\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "[" item ("," item){0,2} "]"\nitem ::= [a-c]{1,2}'
    for seed in SEEDS:
        text, _, _ = _run(tiny, Constraint.grammar(lark), seed=seed)
        assert re.fullmatch(r"\([0-9]{1,3}([+*][0-9]{1,3}){0,3}\)", text), text
        text, _, _ = _run(tiny, Constraint.grammar(gbnf), seed=seed)
        assert re.fullmatch(r"\[[a-c]{1,2}(,[a-c]{1,2}){0,2}\]", text), text


def test_json_object_mode(tiny):
    # Object mode leaves strings unbounded, which a random model never closes; a bias toward
    # the closing characters (a processor, after the constraint stage) lets it finish.
    tok = tiny.tokenizer
    bias = {tok.encode(c, add_special_tokens=False)[0]: 12.0 for c in ('"', "}", "1")}
    for seed in SEEDS:
        text, _, stats = _run(tiny, Constraint.json_object(), seed=seed, sampling={"logit_bias": bias})
        assert stats.finish_reason == "stop", text
        assert isinstance(json.loads(text), dict)


def test_budget_too_small_ends_with_length(tiny):
    text, items, stats = _run(tiny, Constraint.json_schema(SCHEMAS["obj_many_fields"]), max_tokens=5)
    assert stats.finish_reason == "length" and len(items) == 5
    assert '{"f0":'.startswith(text) or text.startswith('{"f0":')


def test_grammar_jump_same_tokens_fewer_forwards(tiny):
    schema = SCHEMAS["order"]
    for temperature, seed in ((0.0, None), (1.0, 3)):
        runs = {}
        for jump in (True, False):
            text, items, stats = _run(tiny, Constraint.json_schema(schema), seed=seed, temperature=temperature,
                                      grammar_jump=jump, sampling={"logprobs": True, "top_logprobs": 2})
            runs[jump] = (text, [(t.token, t.forced) for t in items], stats)
        (t_on, toks_on, s_on), (t_off, toks_off, s_off) = runs[True], runs[False]
        assert t_on == t_off and toks_on == toks_off
        assert s_on.generated_tokens == s_off.generated_tokens and s_on.forced_tokens == s_off.forced_tokens > 0
        assert s_off.forwards == s_off.generated_tokens  # one decode step per token
        assert s_on.forwards < s_off.forwards  # a forced span is one forward
        _validator(schema).validate(json.loads(t_on))


def test_forced_tokens_marked_in_logprobs(tiny):
    _, items, stats = _run(tiny, Constraint.json_schema(SCHEMAS["obj_person"]),
                           sampling={"logprobs": True, "top_logprobs": 3})
    forced = [t for t in items if t.forced]
    assert forced and len(forced) == stats.forced_tokens
    assert all(t.logprob == 0.0 and t.top_logprobs == [(t.token, 0.0)] for t in forced)
    sampled = [t for t in items if not t.forced]
    assert sampled and all(t.logprob is not None and t.logprob <= 0.0 and len(t.top_logprobs) == 3 for t in sampled)
    # a sampled token is one the grammar allowed: every top alternative has a finite logprob
    assert all(np.isfinite(lp) or lp == -np.inf for t in sampled for _, lp in t.top_logprobs)


def test_same_seed_same_output_and_eager_matches_compiled(tiny):
    c = Constraint.json_schema(SCHEMAS["obj_nested"])
    a = _run(tiny, c, seed=5)[0]
    assert a == _run(tiny, c, seed=5)[0]
    assert a == _run(tiny, c, seed=5, compiled=False)[0]
    assert a == _run(tiny, c, seed=5, compiled=False, grammar_jump=False)[0]


def test_bitmask_applied_on_device_matches_numpy():
    rng = np.random.default_rng(0)
    vocab = 100
    allowed = rng.random((3, vocab)) < 0.3
    bits = np.zeros((3, bitmask_words(vocab)), dtype=np.uint32)
    for b, t in zip(*np.nonzero(allowed)):
        bits[b, t // 32] |= np.uint32(1 << (t % 32))
    logits = mx.array(rng.standard_normal((3, vocab)).astype(np.float32))
    out = np.array(apply_bitmask(logits, bits.view(np.int32)))
    assert np.array_equal(np.isfinite(out), allowed)
    assert np.array_equal(out[allowed], np.array(logits)[allowed])


def test_batched_masks_equal_single(tiny):
    vocab = tiny.model.args.vocab_size
    states = [ConstraintState.create(Constraint.json_schema(SCHEMAS[n]), tiny.tokenizer, vocab, tiny.eos_token_ids)
              for n in ("obj_person", "arr_ints", "enum_str")]
    batch = fill_bitmasks([states[0], None, states[1], states[2]])
    assert batch.shape == (4, bitmask_words(vocab))
    assert np.all(batch[1] == -1)
    for row, st in zip((0, 2, 3), states):
        assert np.array_equal(batch[row], st.bitmask()[0])


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_schema_refused(tiny, name):
    with pytest.raises(ConstraintError, match="refused"):
        Constraint.json_schema(UNSUPPORTED[name]).validate()
    with pytest.raises(ConstraintError, match="refused"):
        _run(tiny, Constraint.json_schema(UNSUPPORTED[name]))


@pytest.mark.parametrize("make, match", [
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "must be an object"),
    (lambda: Constraint.regex(""), "non-empty pattern"),
    (lambda: Constraint.regex("[0-9").validate(), "unclosed character class"),
    (lambda: Constraint.choice("yes"), "list of strings"),
    (lambda: Constraint.choice([]), "at least one"),
    (lambda: Constraint.choice(["a", 3]), "non-empty string"),
    (lambda: Constraint.grammar("start: undefined_rule").validate(), "unknown name"),
    (lambda: Constraint.grammar("   "), "source text"),
    (lambda: Constraint("xml", "<a/>"), "kind must be one of"),
])
def test_bad_constraints_refused_with_one_line(make, match):
    with pytest.raises(ConstraintError, match=match) as e:
        make()
    assert "\n" not in str(e.value)


def test_constraint_is_a_value():
    a = Constraint.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert a == Constraint.json_schema('{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert list(json.loads(a.text)["properties"]) == ["b", "a"]  # key order kept (generation order)
    assert len({a, Constraint.regex("x"), Constraint.regex("x")}) == 2


def test_cli_flags(tiny, tmp_path):
    model_dir = tmp_path / "m"
    make_tiny_model_dir(model_dir, "llama")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["obj_person"]))
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "x" [0-9]{2}')
    base = [sys.executable, "-m", "mlx_infer", "generate", "--model", str(model_dir), "--prompt", "hi",
            "--temp", "1", "--seed", "1", "--verbose", "0"]
    out = subprocess.run(base + ["--json-schema", str(schema)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    _validator(SCHEMAS["obj_person"]).validate(json.loads(out.stdout))
    out = subprocess.run(base + ["--regex", "[a-z]{3}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and re.fullmatch("[a-z]{3}\n", out.stdout), out
    out = subprocess.run(base + ["--grammar", str(grammar), "--no-grammar-jump"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and re.fullmatch("x[0-9]{2}\n", out.stdout), out
    for bad, match in ((["--regex", "(a"], "refused"), (["--json-schema", str(tmp_path / "none.json")], "cannot read"),
                       (["--regex", "a", "--grammar", str(grammar)], "give one of")):
        out = subprocess.run(base + bad, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and match in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_SUBSET))
def test_real_model_schema_subset(real_model, name):
    schema = REAL_SUBSET[name]
    # A plain prompt: the embedded Gemma 3 270M is a base model without a chat template (none is invented).
    prompt = "A JSON value for this schema: " + json.dumps(schema) + "\nJSON: "
    for seed in (0, 1):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        with generate(real_model, prompt, sampling=sampling, max_tokens=256,
                      constraint=Constraint.json_schema(schema)) as g:
            text = "".join(t.text for t in g)
        assert g.stats.finish_reason == "stop", text
        _validator(schema).validate(json.loads(text))


def test_engine_batches_constrained_rows(tiny):
    from mlx_infer.engine import Engine, EngineConfig, EngineRequest

    names = sorted(SCHEMAS)[::3]
    prompt = tiny.tokenizer.encode("Hello")
    reqs = [EngineRequest(prompt_ids=prompt, max_tokens=BUDGET, sampling=SamplingParams(temperature=1.0, seed=i),
                          constraint=Constraint.json_schema(SCHEMAS[n])) for i, n in enumerate(names)]
    reqs.append(EngineRequest(prompt_ids=prompt, max_tokens=8))  # an unconstrained row beside them
    reqs.append(EngineRequest(prompt_ids=prompt, max_tokens=BUDGET, constraint=Constraint.regex("[a-z]{2,4}")))
    with Engine(tiny, EngineConfig(page_size=8)).start() as engine:
        results = engine.generate(reqs, timeout=300)
    for n, r in zip(names, results):
        assert r.finish_reason == "stop", (n, r.text)
        _validator(SCHEMAS[n]).validate(json.loads(r.text))
    assert results[-2].finish_reason == "length" and len(results[-2].token_ids) == 8
    assert re.fullmatch("[a-z]{2,4}", results[-1].text)
