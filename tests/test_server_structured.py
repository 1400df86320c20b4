"""Structured output through the server with the openai client: every reply parses and validates.

The schema suite runs as ``response_format={"type": "json_schema", ...}`` (several at once, so
the engine computes a batch of masks per step), regexes and choices through vLLM's fields, and
each other spelling (``structured_outputs``, ``guided_*``, llama.cpp's ``grammar`` /
``json_schema``). An unsupported ``response_format.type`` or a malformed schema is a 400.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app

from structured_schemas import CHOICES, REGEXES, SCHEMAS, UNSUPPORTED
from tiny import make_tiny_model_dir

MESSAGES = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("srv"), "gemma3"))
    engine = Engine(loaded, EngineConfig(page_size=8)).start()
    srv = ServerThread(create_app(engine, model_id="tiny")).start()
    yield SimpleNamespace(url=srv.url, engine=engine)
    srv.stop()
    engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _validate(schema, text):
    cls = jsonschema.Draft202012Validator
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))


def _chat(client, seed, **kw):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=seed,
                                       max_tokens=200, **kw)
    return r.choices[0]


def test_schema_suite_response_format(client):
    def one(job):
        name, seed = job
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        choice = _chat(client, seed, response_format=fmt)
        assert choice.finish_reason == "stop", (name, seed, choice.message.content)
        _validate(SCHEMAS[name], choice.message.content)
        return name

    jobs = [(name, seed) for name in sorted(SCHEMAS) for seed in (0, 1)]
    with ThreadPoolExecutor(8) as pool:  # concurrent: the engine batches constrained rows
        done = list(pool.map(one, jobs))
    assert len(done) == len(jobs)


@pytest.mark.parametrize("pattern", REGEXES)
def test_guided_regex(client, pattern):
    for seed in (0, 1):
        text = _chat(client, seed, extra_body={"guided_regex": pattern}).message.content
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("choices", CHOICES, ids=lambda c: "|".join(c))
def test_guided_choice(client, choices):
    for seed in (0, 1):
        assert _chat(client, seed, extra_body={"guided_choice": choices}).message.content in choices


def test_every_spelling(client):
    schema = SCHEMAS["obj_person"]
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                 {"guided_json": json.dumps(schema)}, {"json_schema": schema}):
        _validate(schema, _chat(client, 3, extra_body=body).message.content)
    for body in ({"structured_outputs": {"regex": "[a-c]{3}"}},):
        assert re.fullmatch("[a-c]{3}", _chat(client, 3, extra_body=body).message.content)
    assert _chat(client, 3, extra_body={"structured_outputs": {"choice": ["x", "y"]}}).message.content in ("x", "y")
    for body in ({"grammar": 'root ::= "n" [0-9]{2}'}, {"guided_grammar": 'start: "n" /[0-9]{2}/'},
                 {"structured_outputs": {"grammar": 'root ::= "n" [0-9]{2}'}}):
        assert re.fullmatch("n[0-9]{2}", _chat(client, 3, extra_body=body).message.content), body


def test_json_object_and_completions(client, server):
    # json_object leaves strings free: biasing the closing characters lets the random model end
    fmt = {"type": "json_object"}
    bias = {"6": 10, "97": 10}  # '"' and '}' in the tiny byte-level vocabulary
    choice = _chat(client, 0, response_format=fmt, logit_bias=bias)
    assert isinstance(json.loads(choice.message.content), dict)
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=200, temperature=1.0, seed=2,
                                  extra_body={"guided_json": SCHEMAS["order"]})
    _validate(SCHEMAS["order"], r.choices[0].text)


def test_streaming_constrained(client):
    schema = SCHEMAS["arr_objects"]
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=4, max_tokens=200,
                                            stream=True, response_format={"type": "json_schema", "json_schema": {
                                                "name": "x", "schema": schema}})
    parts, reasons = [], []
    for ev in stream:
        for c in ev.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    _validate(schema, "".join(parts))
    assert reasons[-1] == "stop"


@pytest.mark.parametrize("body, param, match", [
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED["unevaluated"]}}},
     "response_format", "unevaluatedProperties"),
    ({"guided_regex": "(a"}, "guided_regex", "refused"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output field"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar", "one structured-output"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one constraint"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "xml"),
])
def test_refused_with_400(server, body, param, match):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err
