"""Structured output on the real Gemma 3 270M through the server with the openai client (slow).

A subset of the schema suite (the ones a 270M model finishes in a few dozen tokens), a regex and
a choice list, at temperature 1 with two seeds: every reply parses and validates. The model is a
base model (no chat template), so the requests are completions with ``response_format`` and
vLLM's ``guided_*`` fields.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app

from structured_schemas import REAL_SUBSET

pytestmark = pytest.mark.slow

NAMES = ("classification_pct", "enum_str", "format_date")


@pytest.fixture(scope="module")
def client(real_model):
    engine = Engine(real_model, EngineConfig(memory_budget_gb=1.0)).start()
    srv = ServerThread(create_app(engine, model_id="gemma")).start()
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        srv.stop()
        engine.stop()


def _complete(client, prompt, seed, extra):
    r = client.completions.create(model="gemma", prompt=prompt, temperature=1.0, seed=seed, max_tokens=64,
                                  extra_body=extra)
    return r.choices[0]


def test_schema_subset_regex_and_choice_validate(client):
    for name in NAMES:
        schema = REAL_SUBSET[name]
        prompt = "A JSON value for this schema: " + json.dumps(schema) + "\nJSON: "
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        for seed in (0, 1):
            c = _complete(client, prompt, seed, {"response_format": fmt})
            assert c.finish_reason == "stop", (name, c.text)
            cls = jsonschema.Draft202012Validator
            cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(c.text))
    for seed in (0, 1):
        c = _complete(client, "A date: ", seed, {"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", c.text), c.text
        c = _complete(client, "Is the sky blue? Answer: ", seed, {"guided_choice": ["yes", "no", "maybe"]})
        assert c.text in ("yes", "no", "maybe") and c.finish_reason == "stop"
