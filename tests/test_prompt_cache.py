"""The prompt cache: a second call sharing a prefix reuses it and gives the same tokens."""

import mlx.core as mx
import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.generation.autoregressive import generate_tokens
from mlx_infer.generation.prompt_cache import PromptCache, copy_cache


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def loaded(request, tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("pc") / request.param, request.param))


def _run(loaded, ids, **kw):
    gen = generate_tokens(loaded.model, ids, max_tokens=8, **kw)
    return [t.token for t in gen], gen.stats


def test_next_turn_reuses_the_previous_turn(loaded):
    """A prompt extending an earlier prompt + answer (a chat's next turn) reuses all of it."""
    pc = PromptCache()
    first_prompt = list(range(10, 40))  # 30 tokens: past the tiny gemma3 window (8)
    answer, s1 = _run(loaded, first_prompt, prompt_cache=pc)
    assert s1.cached_tokens == 0 and len(pc) == 1
    turn2 = first_prompt + answer + [60, 61, 62]
    got, s2 = _run(loaded, turn2, prompt_cache=pc)
    assert s2.cached_tokens == len(first_prompt) + len(answer) - 1  # the last answer token was never fed
    assert got == _run(loaded, turn2)[0]


def test_divergent_suffix_trims_back_where_the_cache_allows(loaded):
    pc = PromptCache()
    base = list(range(10, 40))
    _run(loaded, base + [50, 51], prompt_cache=pc)
    got, s = _run(loaded, base + [60, 61, 62], prompt_cache=pc)
    assert got == _run(loaded, base + [60, 61, 62])[0]
    if loaded.config["model_type"] == "llama":
        assert s.cached_tokens == len(base)  # trimmed back to the shared prefix
    else:
        # Sliding-window layers already dropped tokens (32 > window 8): a rotating cache
        # cannot be trimmed back, so the entry is not used (paged KV lifts this).
        assert s.cached_tokens == 0


def test_namespaces_do_not_mix(loaded):
    pc = PromptCache()
    ids = list(range(10, 30))
    _run(loaded, ids, prompt_cache=pc, namespace="adapter-a")
    _, s = _run(loaded, ids, prompt_cache=pc, namespace="adapter-b")
    assert s.cached_tokens == 0


def test_byte_cap_evicts_least_recently_used(loaded):
    probe = PromptCache()
    _run(loaded, list(range(10, 30)), prompt_cache=probe)
    one = probe.nbytes
    pc = PromptCache(max_bytes=int(one * 1.5))
    _run(loaded, list(range(10, 30)), prompt_cache=pc)
    _run(loaded, list(range(100, 120)), prompt_cache=pc)
    assert len(pc) == 1 and pc.nbytes <= pc.max_bytes
    _, s = _run(loaded, list(range(10, 30)), prompt_cache=pc)
    assert s.cached_tokens == 0  # the first entry was evicted


def test_copies_are_independent(loaded):
    cache = loaded.model.make_cache()
    loaded.model(mx.array([list(range(10, 30))]), cache=cache)
    copy = copy_cache(cache)
    loaded.model(mx.array([[5]]), cache=copy)
    assert cache[0].offset == 20 and copy[0].offset == 21
    k_before = mx.array(cache[0].state[0])
    loaded.model(mx.array([[6]]), cache=copy)
    assert mx.array_equal(cache[0].state[0], k_before).item()
