"""Grammar jump in the batching engine and through the server: same results, fewer forwards.

With ``Composition(grammar_jump=True)`` the tokens a constraint forces are committed as one
short prefill over the row's pages (engine/grammar_jump.py); with it off, one decode step each.
Either way a forced token is never sampled (logprob 0, its only top entry itself). Tokens, text,
finish reasons and forced counts must be identical; sampled tokens' logprobs come from a
prefill forward in one case and a decode step in the other, so they agree within 1e-4 (float32
attention over different shapes; measured differences ~7e-6).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from mlx_infer.artifacts.loader import load_model
from mlx_infer.constraints import Constraint
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.generation.bindings.autoregressive import Composition
from mlx_infer.sampling import SamplingParams
from mlx_infer.server import ServerThread, create_app

from structured_schemas import SCHEMAS
from tiny import make_tiny_model_dir

LOGPROB_TOL = 1e-4
CONSTRAINTS = [Constraint.json_schema(SCHEMAS[n]) for n in ("order", "obj_person", "obj_many_fields")] + [
    Constraint.choice(["alpha beta gamma", "alpha delta"]), Constraint.regex(r"id-[0-9]{2}-end")]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param))


def _run(loaded, requests, *, jump: bool, **config):
    with Engine(loaded, EngineConfig(page_size=8, **config), composition=Composition(grammar_jump=jump)) as engine:
        events = {}
        handles = [engine.submit(r, on_token=lambda ev: events.setdefault(ev.request_id, []).append(ev))
                   for r in requests]
        results = [h.result(300) for h in handles]
        return results, engine.stats(), events, engine


def _same(a, b):
    assert (a.token_ids, a.text, a.finish_reason, a.forced_tokens) == (b.token_ids, b.text, b.finish_reason,
                                                                        b.forced_tokens)
    if a.logprobs is not None:
        assert np.allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL, rtol=0)
    if a.top_logprobs is not None:
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]


def test_single_requests_same_tokens_and_forwards_saved_exactly(tiny):
    prompt = tiny.tokenizer.encode("Hello")
    sampling = SamplingParams(logprobs=True, top_logprobs=2)
    for c in CONSTRAINTS:
        req = EngineRequest(prompt_ids=prompt, max_tokens=200, sampling=sampling, constraint=c)
        (on,), s_on, ev_on, _ = _run(tiny, [req], jump=True)
        (off,), s_off, ev_off, _ = _run(tiny, [req], jump=False)
        _same(on, off)
        assert on.finish_reason == "stop" and on.forced_tokens > 0, (c.describe(), on.text)
        # jump off: one forward per generated token (the prompt's prefill gives the first)
        assert s_off["forwards_total"] == len(off.token_ids) and s_off["grammar_jump_forwards_saved_total"] == 0
        # jump on: every forced token committed without a forward of its own
        assert s_on["forwards_total"] + s_on["grammar_jump_forwards_saved_total"] == s_off["forwards_total"]
        assert s_on["forwards_total"] < s_off["forwards_total"]
        assert s_on["forced_tokens_total"] == s_off["forced_tokens_total"] == on.forced_tokens
        assert s_on["generation_tokens_total"] == s_off["generation_tokens_total"] == len(on.token_ids)
        # the stream marks forced tokens: logprob 0, themselves the only top entry, in both modes
        for events in (ev_on[req.request_id], ev_off[req.request_id]):
            assert [e.token for e in events] == on.token_ids and [e.index for e in events] == list(range(len(events)))
            forced = [e for e in events if e.forced]
            assert len(forced) == on.forced_tokens
            assert all(e.logprob == 0.0 and e.top_logprobs == [(e.token, 0.0)] for e in forced)
            assert all(e.logprob < 0.0 for e in events if not e.forced)
        if c.kind == "json_schema":
            jsonschema.validate(json.loads(on.text), json.loads(c.text))


@pytest.mark.parametrize("mixed", [False, True])
def test_batch_seeded_same_results(tiny, mixed):
    prompts = [tiny.tokenizer.encode(p) for p in ("Hello", "A longer prompt for this row", "x")]
    reqs = [EngineRequest(prompt_ids=prompts[i % 3], max_tokens=200, constraint=c,
                          sampling=SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, logprobs=bool(i % 2)))
            for i, c in enumerate(CONSTRAINTS)]
    reqs.append(EngineRequest(prompt_ids=prompts[1], max_tokens=30))  # an unconstrained row beside them
    on, s_on, _, e_on = _run(tiny, reqs, jump=True, mixed_steps=mixed)
    off, s_off, _, _ = _run(tiny, reqs, jump=False, mixed_steps=mixed)
    for a, b in zip(on, off):
        _same(a, b)
    assert all(r.finish_reason == "stop" for r in on[:-1])
    assert s_on["forwards_total"] < s_off["forwards_total"] and s_on["grammar_jump_forwards_saved_total"] > 0
    if mixed and e_on.paged_decode is not None:
        assert e_on.mixed_steps > 0  # spans rode the decode step as chunks


def test_span_cut_by_max_tokens_and_preemption(tiny):
    prompt = tiny.tokenizer.encode("Hello")
    c = Constraint.json_schema(SCHEMAS["obj_many_fields"])
    for limit in (3, 7, 12):  # the limit falls inside a forced span
        req = EngineRequest(prompt_ids=prompt, max_tokens=limit, constraint=c)
        (on,), _, _, _ = _run(tiny, [req], jump=True)
        (off,), _, _, _ = _run(tiny, [req], jump=False)
        _same(on, off)
        assert on.finish_reason == "length" and len(on.token_ids) == limit
    # a pool so small that rows are preempted (and recomputed) while spans are pending
    reqs = [EngineRequest(prompt_ids=[10 + i] + prompt * 3, max_tokens=120, constraint=c)  # no shared page
            for i in range(4)]
    on, s_on, _, _ = _run(tiny, reqs, jump=True, num_pages=14, max_batch=4)
    off, _, _, _ = _run(tiny, reqs, jump=False, num_pages=14, max_batch=4)
    for a, b in zip(on, off):
        _same(a, b)
    assert s_on["preemptions_total"] > 0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    loaded = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("jump-srv"), "gemma3"))
    out = {}
    for jump in (True, False):
        engine = Engine(loaded, EngineConfig(page_size=8), composition=Composition(grammar_jump=jump)).start()
        srv = ServerThread(create_app(engine, model_id="tiny")).start()
        out[jump] = SimpleNamespace(url=srv.url, engine=engine, srv=srv)
    yield out
    for s in out.values():
        s.srv.stop()
        s.engine.stop()


def test_server_same_replies_fewer_forwards(servers):
    schema = SCHEMAS["order"]
    replies, forwards = {}, {}
    for jump, s in servers.items():
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        before = s.engine.stats()["forwards_total"]
        got = []
        for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}},
                      {"guided_choice": ["alpha beta gamma", "alpha delta"]}):
            r = client.completions.create(model="tiny", prompt="Hello", max_tokens=200, temperature=0, logprobs=2,
                                          extra_body=extra)
            c = r.choices[0]
            got.append((c.text, c.finish_reason, c.logprobs.tokens, c.logprobs.token_logprobs))
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model="tiny", prompt="Hello", max_tokens=200, temperature=0, stream=True,
            extra_body={"guided_json": schema}) if ch.choices)
        got.append(streamed)
        replies[jump] = got
        forwards[jump] = s.engine.stats()["forwards_total"] - before
    for a, b in zip(replies[True], replies[False]):
        if isinstance(a, str):
            assert a == b
            continue
        assert a[:3] == b[:3]
        assert np.allclose(a[3], b[3], atol=LOGPROB_TOL, rtol=0)
    jsonschema.validate(json.loads(replies[True][0][0]), schema)
    assert replies[True][2] == replies[True][0][0]  # streamed = whole
    assert forwards[True] < forwards[False]
    metrics = httpx.get(servers[True].url + "/metrics", timeout=30).text
    assert "mlx_infer_grammar_jump_forwards_saved_total" in metrics


def test_serve_switch(tmp_path, monkeypatch):
    import mlx_infer.server as server_pkg
    from mlx_infer import cli
    from mlx_infer.server import ServeOptions
    from mlx_infer.server.run import build

    d = make_tiny_model_dir(tmp_path, "llama")
    for flag, want in (([], True), (["--no-grammar-jump"], False)):
        seen = {}
        monkeypatch.setattr(server_pkg, "serve", lambda options: seen.setdefault("options", options))
        args = cli.build_parser().parse_args(["serve", "--model", str(d), *flag])
        args.func(args)
        assert seen["options"].grammar_jump is want
        _, engine, _ = build(ServeOptions(model=str(d), grammar_jump=want, memory_budget_gb=0.5))
        try:
            assert engine.call(_grammar_jump) is want  # asked in the engine's process
        finally:
            engine.stop()


def _grammar_jump(engine) -> bool:
    return engine.grammar_jump
