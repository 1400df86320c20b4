"""Tool calling through the server: the openai client and LangChain's ChatOpenAI.

The tiny model gets a Hermes-style template (tools in the system turn, ``<tool_call>`` markup,
``<tool_response>`` turns). A forced call (``required`` or a named function) is constrained by
the function's parameter schema, so even a random model's call has valid arguments every time.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig
from mlx_infer.server import ServerThread, create_app
from mlx_infer.server.tools import ToolPlan, detect_format, template_messages
from tiny import make_tiny_model_dir

TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function'] | tojson }}{% endfor %}"
    "{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}"
    "</tool_response>{% else %}{{ m['content'] or '' }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("tools"), "gemma3", max_position_embeddings=2048)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOL_TEMPLATE}))
    loaded = load_model(d)
    engine = Engine(loaded, EngineConfig(page_size=8)).start()
    srv = ServerThread(create_app(engine, model_id="tiny")).start()
    yield SimpleNamespace(url=srv.url, engine=engine, loaded=loaded)
    srv.stop()
    engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check(call):
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])


def test_named_function_always_valid(client):
    for seed in range(6):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        _check(c.message.tool_calls[0])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_valid(client, parallel):
    names = set()
    for seed in range(6):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0,
                                           tool_choice="required", parallel_tool_calls=parallel)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        if not parallel:
            assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            _check(call)
            names.add(call.function.name)
    assert names <= {"get_weather", "add"}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "add"}}, "required"])
def test_streamed_deltas_reassemble(client, choice):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, seed=11, temperature=1.0, tool_choice=choice)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            reasons.append(ch.finish_reason)
            assert not ch.delta.content  # no markup or JSON leaks into content
            for d in ch.delta.tool_calls or ():
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function.name:
                    c["name"] = d.function.name
                c["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole]


def test_auto_round_trip(client, server):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=1, temperature=1.0,
                                           tool_choice="required").choices[0].message
    history = MESSAGES + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21})} for c in first.tool_calls]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="auto", max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the template saw: the call and the tool result, rendered in its own markup
    plan = ToolPlan(TOOLS, "auto", None, server.loaded.tokenizer.chat_template)
    msgs = template_messages([m if isinstance(m, dict) else m for m in history])
    text = server.loaded.tokenizer.decode(server.loaded.tokenizer.apply_chat_template(msgs, tools=plan.template_tools))
    call = first.tool_calls[0]
    assert f'<tool_call>{{"name": "{call.function.name}", "arguments": ' in text
    assert json.dumps(json.loads(call.function.arguments), ensure_ascii=False) in text
    assert '<tool_response>{"temp": 21}</tool_response>' in text and '"name": "add"' in text


def test_tool_choice_none_renders_no_tools(server):
    plan = ToolPlan(TOOLS, "none", None, TOOL_TEMPLATE)
    assert plan.template_tools is None and plan.constraint is None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- parsing per template family ----------------------------------------------------------

NAMES = {"get_weather", "add"}


@pytest.mark.parametrize("template, text, content, calls", [
    ("{{ '<tool_call>' }}", 'Let me check.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "Let me check.", [("add", {"a": 1, "b": 2})]),
    ("<tool_call>", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>'
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>', None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ("[TOOL_CALLS]", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}]', None, [("add", {"a": 3, "b": 4})]),
    ("<|python_tag|>", '{"name": "add", "parameters": {"a": 5, "b": 6}}', None, [("add", {"a": 5, "b": 6})]),
    ("<|tool_call>", 'ok <|tool_call>call:add{"a": 7, "b": 8}<tool_call|>', "ok", [("add", {"a": 7, "b": 8})]),
    ("plain gemma 3", '```tool_call\n{"name": "add", "arguments": {"a": 9, "b": 0}}\n```', None,
     [("add", {"a": 9, "b": 0})]),
    ("plain gemma 3", '{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),  # unknown tool
    ("<tool_call>", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("<tool_call>", "Just text.", "Just text.", []),
])
def test_parsers(template, text, content, calls):
    plan = ToolPlan(TOOLS, "auto", None, template)
    got_content, got = plan.parse(text, "stop")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_stream_holds_back_markup():
    plan = ToolPlan(TOOLS, "auto", None, "<tool_call>")
    deltas = []
    for piece in ["Sure", ", one moment <tool", "_call>{\"name\": \"add\", ", "\"arguments\": {\"a\": 1, \"b\": 2}}",
                  "</tool_call>"]:
        deltas += plan.feed(piece)
    last, reason = plan.end("stop")
    deltas += last
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Sure, one moment " and reason == "tool_calls"
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["add"]
    plain = ToolPlan(TOOLS, "auto", None, "<tool_call>")
    out = plain.feed("a <tool") + plain.feed(" no call") + plain.end("stop")[0]
    assert "".join(d["content"] for d in out) == "a <tool no call"


def test_detect_format():
    assert [detect_format(t).name for t in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call>", "")] == \
        ["hermes", "mistral", "llama3_json", "gemma4", "json"]


# -- LangChain ---------------------------------------------------------------------------


def test_langchain_bind_tools_and_structured_output(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """Weather in a city."""

        city: str = Field(max_length=8)
        celsius: int = Field(ge=-50, le=50)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", temperature=1.0, max_retries=0,
                     timeout=120)
    # strict=True: LangChain then closes the schema (additionalProperties false); without it any
    # extra keys are valid arguments, which a random model adds forever
    for seed in range(3):
        forced = llm.bind(seed=seed).bind_tools([Weather], tool_choice="Weather", strict=True)
        msg = forced.invoke("What is the weather in Paris?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather"
        Weather(**msg.tool_calls[0]["args"])
        for method in ("json_schema", "function_calling"):
            out = llm.bind(seed=seed).with_structured_output(Weather, method=method, strict=True).invoke("Oslo?")
            assert isinstance(out, Weather)
    # streamed tool-call chunks reassemble into the same call
    chunks = list(llm.bind(seed=1).bind_tools([Weather], tool_choice="Weather", strict=True).stream("Weather?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.tool_calls and Weather(**merged.tool_calls[0]["args"])
