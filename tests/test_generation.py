"""The generation loop on tiny random models: it must equal a plain loop without cache."""

import mlx.core as mx
import pytest
from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.errors import MlxInferError
from mlx_infer.generation.autoregressive import generate, generate_tokens
from mlx_infer.sampling import SamplingParams


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def loaded(request, tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("m") / request.param, request.param))


def _reference_greedy(model, ids, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1]
        t = int(mx.argmax(logits).item())
        out.append(t)
        ids.append(t)
    return out


@pytest.mark.parametrize("prefill_step_size", [2048, 3])
def test_greedy_equals_uncached_reference(loaded, prefill_step_size):
    # 20 prompt tokens + 12 generated: past the gemma3 tiny window (8) on sliding layers.
    prompt = loaded.tokenizer.encode("The capital of France is Paris. Hello world!")[:20]
    got = [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=12,
                                            prefill_step_size=prefill_step_size)]
    assert got == _reference_greedy(loaded.model, prompt, 12)


def test_seeded_sampling_reproduces_and_seeds_differ(loaded):
    prompt = loaded.tokenizer.encode("Hello")
    run = lambda seed: [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=16,
                                                         sampling=SamplingParams(temperature=1.5, seed=seed))]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_stats_and_finish_reasons(loaded):
    prompt = loaded.tokenizer.encode("Hello world")
    gen = generate_tokens(loaded.model, prompt, max_tokens=5)
    tokens = list(gen)
    assert [t.index for t in tokens] == list(range(5))
    assert tokens[-1].finish_reason == "length"
    s = gen.stats
    assert (s.prompt_tokens, s.generated_tokens, s.finish_reason) == (len(prompt), 5, "length")
    assert s.cache_tokens == len(prompt) + 4  # the last token is never fed back
    assert s.prefill_ms > 0 and s.peak_memory_gb > 0


def test_eos_stops(loaded):
    prompt = loaded.tokenizer.encode("Hello world")
    first = next(iter(generate_tokens(loaded.model, prompt, max_tokens=1))).token
    gen = generate_tokens(loaded.model, prompt, max_tokens=10, eos_token_ids={first})
    tokens = list(gen)
    assert len(tokens) == 1 and tokens[0].finish_reason == "stop"


def test_breaking_out_settles_stats(loaded):
    gen = generate_tokens(loaded.model, loaded.tokenizer.encode("Hello"), max_tokens=50)
    with gen:
        for t in gen:
            if t.index == 2:
                break
    assert gen.stats.generated_tokens == 3
    assert gen.stats.finish_reason == "cancelled"


def test_text_stream_matches_decode(loaded):
    gen = generate(loaded, "Hello", max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=3))
    items = list(gen)
    ids = [t.token for t in items if t.token not in loaded.eos_token_ids]
    assert "".join(t.text for t in items) == loaded.tokenizer.decode(ids)


def test_chat_template_applied(loaded):
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == loaded.tokenizer.bos_token_id
    assert loaded.tokenizer.decode(ids).endswith("<|assistant|>")


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"prefill_step_size": 0}, "prefill_step_size"),
    ({"sampling": {"temperature": 0.5}}, "SamplingParams"),
])
def test_bad_arguments(loaded, kwargs, match):
    with pytest.raises(MlxInferError, match=match):
        list(generate_tokens(loaded.model, [0, 5], **kwargs))


def test_empty_prompt(loaded):
    with pytest.raises(MlxInferError, match="empty"):
        generate_tokens(loaded.model, [])


def test_seeded_request_draws_the_same_alone_and_in_a_batch(loaded):
    """Batch independence: each row has its own key sequence and sampler."""
    from mlx_infer.generation.static_batch import generate_batch

    prompts = [list(range(10, 22)), list(range(40, 52)), list(range(70, 82))]
    params = [SamplingParams(temperature=1.2, seed=5), SamplingParams(temperature=0.9, seed=6, top_k=20),
              SamplingParams()]
    rows, stats = generate_batch(loaded.model, prompts, max_tokens=10, sampling=params)
    for prompt, p, row in zip(prompts, params, rows):
        alone = [t.token for t in generate_tokens(loaded.model, prompt, max_tokens=10, sampling=p)]
        assert row == alone
    assert stats.generated_tokens == 30


def test_compiled_decode_gives_the_eager_tokens_and_state(loaded):
    """generate() uses the binding's compiled step by default; tokens, text and cache match eager."""
    runs = {}
    for compiled in (True, False):
        gen = generate(loaded, "The capital of France is", max_tokens=24, compiled=compiled)
        items = list(gen)
        runs[compiled] = ([t.token for t in items], "".join(t.text for t in items), gen.stats.cache_tokens)
    assert runs[True] == runs[False]
