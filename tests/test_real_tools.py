"""Tool calling on the real Gemma 3 270M through the server, with the openai client (slow).

The embedded model is a base model without a chat template, so the server is given one, as
``mlx-infer serve --chat-template`` would: Gemma 3's turn markup, the tools listed as JSON in the
first user turn, tool results as a user turn (the ``json`` tool-call family: a reply that is a
JSON call). A forced call (a named function or ``required``) is constrained by the function's
parameter schema, so it is valid every time, at temperature 1 and whatever the seed; ``auto``
takes a call, its tool result and returns a final answer. Few requests, short ``max_tokens``.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from mlx_infer.server.tools import ToolPlan, template_messages

pytestmark = pytest.mark.slow

GEMMA3_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<start_of_turn>user\nTool result: {{ m['content'] }}<end_of_turn>\n"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.first and tools %}You may call these functions by answering with JSON "
    "{\"name\": ..., \"arguments\": {...}}:\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "{% endif %}{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}{% endfor %}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(real_model):
    tok = real_model.tokenizer
    saved = tok.chat_template
    tok.chat_template = GEMMA3_TOOLS_TEMPLATE  # what --chat-template does
    engine = Engine(real_model, EngineConfig(memory_budget_gb=1.0)).start()
    srv = ServerThread(create_app(engine, model_id="gemma")).start()
    try:
        yield srv
    finally:
        srv.stop()
        engine.stop()
        tok.chat_template = saved


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _valid(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])


def test_forced_calls_are_valid_every_time(client):
    for seed in (0, 1):
        r = client.chat.completions.create(model="gemma", messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0,
                                           max_tokens=48,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        _valid(c.message.tool_calls[0])
        r = client.chat.completions.create(model="gemma", messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0,
                                           max_tokens=64, tool_choice="required", parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        _valid(c.message.tool_calls[0])


def test_auto_round_trip_with_a_tool_result(client, real_model):
    call = client.chat.completions.create(model="gemma", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=48,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}}
                                          ).choices[0].message
    history = MESSAGES + [call.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})}
        for c in call.tool_calls]
    r = client.chat.completions.create(model="gemma", messages=history, tools=TOOLS, tool_choice="auto",
                                       temperature=0, max_tokens=24)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.finish_reason == "tool_calls":  # a parsed call names a real tool with arguments that are an object
        assert all(t.function.name in SCHEMA and isinstance(json.loads(t.function.arguments), dict)
                   for t in c.message.tool_calls)
    else:
        assert c.message.content and not c.message.tool_calls
    # the template saw the call and its result in its own markup
    plan = ToolPlan(TOOLS, "auto", None, GEMMA3_TOOLS_TEMPLATE)
    text = real_model.tokenizer.decode(real_model.tokenizer.apply_chat_template(template_messages(history),
                                                                                tools=plan.template_tools))
    args = json.dumps(json.loads(call.tool_calls[0].function.arguments), ensure_ascii=False)
    assert '{"name": "get_weather", "arguments": ' + args in text
    assert 'Tool result: {"temperature": 18, "unit": "celsius"}' in text
    # streamed, a forced call's deltas reassemble to the same call
    kw = dict(model="gemma", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=48,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args = ""
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            assert not ch.delta.content
            for d in ch.delta.tool_calls or ():
                args += d.function.arguments or ""
    assert json.loads(args) == json.loads(call.tool_calls[0].function.arguments)
