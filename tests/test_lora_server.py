"""Adapters through the server (issue 21), with the ``openai`` client: ``--lora`` adapters are
models in /v1/models, chosen by ``model`` or an ``adapter`` field, each giving the tokens it
gives alone; POST/DELETE /v1/adapters at run time; bad adapters are 4xx and the server keeps
serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest

from lora_helpers import make_mlx_adapter
from tiny import make_tiny_model_dir

from mlx_infer.adapters import attach_adapter
from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.server.run import ServeOptions, ServerThread, build

N = 8
PROMPT = [5, 17, 33, 2, 90, 41]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("lora-server")
    d = make_tiny_model_dir(root / "tiny", "llama")
    paths = {f"a{i}": make_mlx_adapter(d, root / f"a{i}", seed=60 + i, b_std=1.0, rank=4 + 4 * i) for i in range(3)}
    ref = load_model(d)  # the server's kernels (the default)
    want = {None: [t.token for t in generate_tokens(ref.model, PROMPT, max_tokens=N)]}
    for name, p in paths.items():
        attach_adapter(ref.model, p, name=name)
        want[name] = [t.token for t in generate_tokens(ref.model, PROMPT, max_tokens=N, adapter=name)]
    assert len({tuple(v) for v in want.values()}) == len(want)
    text = {k: _render(ref, v) for k, v in want.items()}
    app, engine, model_id = build(ServeOptions(model=str(d), page_size=4,
                                               loras=(("a0", str(paths["a0"])), ("a1", str(paths["a1"])))))
    server = ServerThread(app).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        yield server, client, engine, model_id, paths, text, root
    finally:
        server.stop()
        engine.stop()


def _render(loaded, tokens: list[int]) -> str:
    detok = loaded.tokenizer.detokenizer()
    return "".join(detok.add(t) for t in tokens) + detok.flush()


def complete(client, model: str, **extra) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True, "skip_special_tokens": False, **extra})
    return r.choices[0].text


def test_models_list_and_selection(served):
    server, client, engine, model_id, paths, text, _ = served
    ids = [m.id for m in client.models.list().data]
    assert ids == [model_id, "a0", "a1"]
    entry = httpx.get(server.url + "/v1/models/a1").json()
    assert entry["parent"] == model_id and entry["root"] == str(paths["a1"])
    assert complete(client, model_id) == text[None]
    assert complete(client, "a0") == text["a0"]
    assert complete(client, "a1") == text["a1"]
    assert complete(client, model_id, adapter="a1") == text["a1"]
    r = client.completions.create(model="a0", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.model == "a0"  # the adapter that served it (vLLM's convention)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "a1"
    assert client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2).model == model_id
    with pytest.raises(openai.NotFoundError):
        complete(client, model_id, adapter="nope")
    with pytest.raises(openai.NotFoundError):
        complete(client, "nope")
    assert engine.call(_compiled_with_adapters)  # compiled, no fallback (in the engine's process)


def _compiled_with_adapters(engine) -> bool:
    step = engine.paged_decode
    return step is not None and not step.failed and bool(step.adapters.active)


def test_concurrent_requests_over_adapters(served):
    from concurrent.futures import ThreadPoolExecutor

    server, client, engine, model_id, paths, text, _ = served
    jobs = [model_id, "a0", "a1"] * 4
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda m: complete(client, m), jobs))
    assert got == [text[None if m == model_id else m] for m in jobs]


def test_load_unload_at_run_time_and_bad_adapters(served):
    server, client, engine, model_id, paths, text, root = served
    url = server.url
    bad = root / "bad-shape"
    shutil.copytree(paths["a2"], bad)
    w = dict(mx.load(str(bad / "adapters.safetensors")))
    w["model.layers.0.self_attn.q_proj.lora_a"] = mx.zeros((10, 12))
    mx.save_safetensors(str(bad / "adapters.safetensors"), w)
    truncated = root / "bad-truncated"
    shutil.copytree(paths["a2"], truncated)
    raw = (truncated / "adapters.safetensors").read_bytes()
    (truncated / "adapters.safetensors").write_bytes(raw[:100])
    rank0 = root / "bad-rank0"
    shutil.copytree(paths["a2"], rank0)
    cfg = json.loads((rank0 / "adapter_config.json").read_text())
    cfg["lora_parameters"]["rank"] = 0
    (rank0 / "adapter_config.json").write_text(json.dumps(cfg))
    for path, words in ((bad, "do not fit"), (truncated, "truncated"), (rank0, "rank"),
                        (root / "missing", "not a directory")):
        r = httpx.post(url + "/v1/adapters", json={"name": "x", "path": str(path)}, timeout=60)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
    assert complete(client, "a0") == text["a0"]  # still serving
    r = httpx.post(url + "/v1/adapters", json={"name": "a0", "path": str(paths["a2"])}, timeout=60)
    assert r.status_code == 409
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(paths["a2"])}, timeout=60)
    assert r.status_code == 200, r.text
    assert complete(client, "a2") == text["a2"]
    assert "a2" in [m.id for m in client.models.list().data]
    # in use: a streaming request holds a0 until it ends
    stream = client.completions.create(model="a0", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    r = httpx.delete(url + "/v1/adapters/a0", timeout=60)
    assert r.status_code == 409, r.text
    stream.close()
    for _ in range(200):  # the engine releases it once it sees the cancel
        r = httpx.delete(url + "/v1/adapters/a0", timeout=60)
        if r.status_code != 409:
            break
        threading_sleep(0.05)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "a0")
    assert httpx.delete(url + "/v1/adapters/a0", timeout=60).status_code == 404
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60).status_code == 200
    assert complete(client, "a1") == text["a1"]


def threading_sleep(s: float) -> None:
    import time

    time.sleep(s)


def _bank_bytes(engine) -> tuple[int, set[str]]:
    from mlx_infer.adapters import bank_of

    bank = bank_of(engine.model)
    return bank.nbytes, set(bank.names)


def _projected(engine, path: str) -> int:
    from mlx_infer.adapters import bank_of, load_adapter

    return bank_of(engine.model).projected_nbytes(load_adapter(path, engine.model, name="big"))


def _pool(engine) -> tuple[int, int]:
    from mlx_infer.server.adapters import pool_bytes

    return pool_bytes(engine), engine.store.nbytes


def _budget(engine, total: int | None) -> None:
    """The memory budget the engine's process reads, fixed at ``total`` bytes (``None``: the real one again)."""
    from mlx_infer.engine import config as engine_config

    real = getattr(engine_config, "_real_kv_budget", engine_config.kv_budget)
    engine_config._real_kv_budget = real
    engine_config.kv_budget = real if total is None else (lambda model, config: engine_config.KVBudget(total, "test"))


def test_run_time_load_is_checked_against_the_memory_budget(served):
    """POST /v1/adapters refuses (413) an adapter that would grow the bank past what the memory budget
    leaves beside the KV pool, and takes it when it just fits (the projection is the bank's real size).
    The bank and the budget live in the engine's process: the test reads and sets them there."""
    server, client, engine, model_id, paths, text, root = served
    url = server.url
    big = make_mlx_adapter(root / "tiny", root / "big", seed=90, rank=24, b_std=1.0)  # a larger rank: stacks grow
    before = engine.call(_bank_bytes)[0]
    need = engine.call(_projected, str(big))
    assert need > before
    pool, allocated = engine.call(_pool)
    assert pool >= allocated  # the whole pool, allocated or not yet
    try:
        for spare, status in ((need - before - 1, 413), (need - before, 200)):
            engine.call(_budget, pool + spare)
            r = httpx.post(url + "/v1/adapters", json={"name": "big", "path": str(big)}, timeout=60)
            assert r.status_code == status, r.text
            if status == 413:
                err = r.json()["error"]
                assert err["code"] == "adapter_too_large" and "memory budget" in err["message"]
                nbytes, names = engine.call(_bank_bytes)
                assert nbytes == before and "big" not in names
                assert complete(client, "a1") == text["a1"]  # still serving
    finally:
        engine.call(_budget, None)
    assert engine.call(_bank_bytes)[0] == need
    assert httpx.delete(url + "/v1/adapters/big", timeout=60).status_code == 200
