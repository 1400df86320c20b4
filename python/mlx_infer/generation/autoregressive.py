"""The autoregressive generation loop.

``generate_tokens`` works on token ids; ``generate`` adds the tokenizer: it
encodes the prompt (optionally through the chat template), streams text, and
applies stop strings.

The loop pipelines: step n+1 is queued (``mx.async_eval``) before token n is
handed to the caller, so the device works while Python runs the caller's code.
Two things turn pipelining off, because step n+1 then needs token n on the
host first: penalties (they read the token history) and ``pipeline=False``
(checkpointing: the state must be exactly "prompt + tokens so far" at each yield).

Decode steps after the first run through the binding's compiled C++ step
when one is given (``decode=``); it reads and updates the plain caches
themselves each step (it holds no KV), so prompt caches and stats see the same
state as an eager run.

Prefill runs the prompt, except its last token, through the graph's hidden
phase in chunks (no LM head: the vocabulary projection is only needed for the
last position); the last prompt token is the first decode step. A cache that
already holds a prefix of the prompt (prompt cache, resumed checkpoint) skips
that prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import mlx.core as mx

from .. import defaults
from ..adapters.bank import bank_of
from ..adapters.select import selected
from ..errors import MlxInferError, PromptTooLongError
from ..sampling import RequestRNG, SamplingParams, make_sampler
from .prompt_cache import PromptCache
from .stopping import CancelToken
from .text_output import TextOutput, TokenEvent, token_finish, token_limit

if TYPE_CHECKING:
    from ..artifacts.loader import LoadedModel

DEFAULT_MAX_TOKENS = defaults.MAX_TOKENS
DEFAULT_PREFILL_STEP_SIZE = defaults.PREFILL_STEP_SIZE
GREEDY = SamplingParams()


#: The event ``generate`` yields: :class:`~.text_output.TokenEvent` (the engine's event too; ``request_id`` is
#: ``None`` here and ``token`` always set). This older name is kept for API compatibility.
GeneratedToken = TokenEvent


@dataclass
class GenerateStats:
    """What a generation cost; settled even when the caller breaks out early.

    ``forwards`` counts model forwards after prefill (decode steps, and grammar-jump spans);
    ``forced_tokens`` counts tokens a constraint forced (see :mod:`.constrained`).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    cache_tokens: int = 0
    peak_memory_gb: float = 0.0
    finish_reason: str | None = None
    forwards: int = 0
    forced_tokens: int = 0

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens computed per second (cached ones excluded)."""
        n = self.prompt_tokens - self.cached_tokens
        return n / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second after the first one."""
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1e3) if n > 0 and self.decode_ms > 0 else 0.0


@dataclass
class RunState:
    """The live state of one generation, readable between yields.

    With ``pipeline=False``, at each yield of token n the cache holds exactly
    ``prompt + tokens[:n]`` (token n is not fed yet) and ``rng`` has made the
    draws of tokens 0..n: what a checkpoint saves.
    """

    prompt_ids: list[int]
    cache: list[Any]
    rng: RequestRNG
    tokens: list[int] = field(default_factory=list)


class Generation(Iterator[TokenEvent]):
    """An iterator of :class:`TokenEvent`; ``stats`` is final once it ends or is closed.

    Breaking out of a ``for`` loop leaves it suspended; call :meth:`close` (or
    use it as a context manager) to release the KV state at once. It is also
    released when the object is garbage-collected.
    """

    def __init__(self, tokens: Iterator[TokenEvent], stats: GenerateStats, state: RunState | None = None):
        self._tokens = tokens
        self.stats = stats
        self.state = state

    def __next__(self) -> TokenEvent:
        return next(self._tokens)

    def close(self) -> None:
        """Stop generating and release all state."""
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _validate(max_tokens: int, prefill_step_size: int, prompt_len: int, context: int | None) -> None:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise MlxInferError(f"max_tokens must be a non-negative integer, got {max_tokens!r}.")
    if prefill_step_size < 1:
        raise MlxInferError(f"prefill_step_size must be >= 1, got {prefill_step_size}.")
    if prompt_len == 0:
        raise MlxInferError("The prompt is empty: give at least one token.")
    if context is not None and prompt_len > context:
        raise PromptTooLongError(
            f"The prompt has {prompt_len} tokens but the model's context window is {context} "
            f"tokens. Shorten the prompt by at least {prompt_len - context} tokens."
        )


def _check_ids(prompt_ids: list[int], vocab_size: int | None) -> None:
    """Token ids outside the embedding would read past its rows (a tokenizer larger than the
    model's vocabulary, or ids from elsewhere): refuse them by position."""
    for i, t in enumerate(prompt_ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise MlxInferError(f"prompt token {i} is {t!r}, outside the model's vocabulary "
                                f"(0..{'?' if vocab_size is None else vocab_size - 1}); the tokenizer does "
                                "not match this model, or the ids come from another one.")


def generate_tokens(
    model: Any,
    prompt_ids: list[int],
    *,
    sampling: SamplingParams = GREEDY,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    eos_token_ids: Iterable[int] = (),
    newline_token_ids: Iterable[int] = (),
    context_length: int | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    cancel: CancelToken | None = None,
    cache: list[Any] | None = None,
    rng: RequestRNG | None = None,
    start_index: int = 0,
    pipeline: bool = True,
    prompt_cache: PromptCache | None = None,
    namespace: str = "",
    decode: Any | None = None,
    constraint: Any | None = None,
    grammar_jump: bool = True,
    on_prefill: Callable[[int, int], None] | None = None,
    adapter: str | None = None,
) -> Generation:
    """Generate token ids after ``prompt_ids``.

    Args:
        model: a graph (see :class:`mlx_infer.contracts.Graph`).
        prompt_ids: the prompt's token ids (non-empty).
        sampling: the request's :class:`SamplingParams` (default: greedy).
        max_tokens: the most tokens to generate.
        eos_token_ids: tokens that end the generation (they are yielded, with
            ``finish_reason="stop"``).
        newline_token_ids: tokens XTC must never remove.
        context_length: the model's window; the prompt must fit, and
            generation stops with ``"length"`` when the window is full.
        prefill_step_size: prompt tokens per prefill chunk.
        cancel: a :class:`CancelToken` another thread may trigger.
        cache: a cache already holding a prefix of ``prompt_ids`` (its
            ``offset`` tokens, at most ``len(prompt_ids) - 1``); default: a new one.
        rng: the request's key sequence (default: from ``sampling.seed``).
        start_index: index of the first generated token (a resumed run continues its count).
        pipeline: queue step n+1 before yielding token n (see the module docstring).
        prompt_cache: reuse the longest cached prefix of ``prompt_ids`` from it
            (when no ``cache`` is given), and store this run's cache there at the end.
        namespace: the prompt-cache namespace (e.g. the active adapter set).
        decode: a compiled decode step (``step(tokens, state) -> logits``,
            ``close()``; see ``AutoregressiveBinding.create_decode``)
            for every step after the first; it is closed when the generation ends.
        constraint: a :class:`~mlx_infer.constraints.ConstraintState` the output must satisfy
            (see :mod:`.constrained`); the generation ends when its grammar is complete.
        grammar_jump: feed tokens the constraint forces as one forward (else one step each).
        on_prefill: called ``(done, total)`` after each prefill chunk (prompt tokens in the cache out of
            the ``len(prompt_ids) - 1`` the prefill computes), e.g. for a progress bar.
        adapter: the name of an adapter in the model's bank (:mod:`mlx_infer.adapters`) to run
            with; ``None``: the bank's default (``load(path, adapter=...)``), or none. The
            prompt-cache namespace then includes the adapter's identity.

    Returns:
        A :class:`Generation` (iterator of :class:`TokenEvent` with ``stats`` and ``state``).
    """
    prompt_ids = list(prompt_ids)
    _validate(max_tokens, prefill_step_size, len(prompt_ids), context_length)
    _check_ids(prompt_ids, getattr(getattr(model, "args", None), "vocab_size", None))
    if not isinstance(sampling, SamplingParams):
        raise MlxInferError(f"sampling must be a SamplingParams, got {type(sampling).__name__}.")
    eos = frozenset(eos_token_ids)
    bank = bank_of(model)
    if adapter is None and bank is not None:
        adapter = bank.default
    if adapter is not None:
        if bank is None:
            raise MlxInferError(f"adapter {adapter!r} was asked for but the model has no adapters loaded; "
                                "pass adapter= to load() or generate() with an adapter directory.")
        namespace = bank.namespace(adapter) + ("|" + namespace if namespace else "")
    sampler = make_sampler(sampling, eos_token_ids=tuple(eos), newline_token_ids=tuple(newline_token_ids))
    if cache is None and prompt_cache is not None:
        cache, _ = prompt_cache.fetch(prompt_ids, namespace)
    cache = model.make_cache() if cache is None else cache
    cached = max((c.offset for c in cache), default=0)
    if cached >= len(prompt_ids):
        raise MlxInferError(f"the given cache holds {cached} tokens; it must hold fewer than the "
                            f"prompt's {len(prompt_ids)} so the last prompt token yields logits.")
    state = RunState(prompt_ids=prompt_ids, cache=cache, rng=rng or RequestRNG(sampling.seed))
    stats = GenerateStats(prompt_tokens=len(prompt_ids), cached_tokens=cached)
    limit = token_limit(max_tokens, len(prompt_ids), context_length)
    pipeline = pipeline and not sampler.processors
    if constraint is not None:
        from .constrained import run_constrained

        run = run_constrained(model, state, sampler, limit, eos, prefill_step_size, cancel, start_index,
                              stats, decode, constraint, grammar_jump, on_prefill)
    else:
        run = _run(model, state, sampler, limit, eos, prefill_step_size, cancel, start_index, pipeline,
                   stats, decode, on_prefill)
    run = selected(bank, adapter, run)
    if prompt_cache is not None:
        run = _storing(run, state, prompt_cache, namespace)
    return Generation(run, stats, state)


def _storing(run: Iterator[TokenEvent], state: RunState, prompt_cache: PromptCache,
             namespace: str) -> Iterator[TokenEvent]:
    try:
        yield from run
    finally:
        run.close()  # type: ignore[attr-defined]
        offset = max((c.offset for c in state.cache), default=0)
        fed = (state.prompt_ids + state.tokens)[:offset]
        prompt_cache.store(fed, state.cache, namespace)


def prefill(model: Any, cache: list[Any], prompt: mx.array, done: int, step_size: int,
            cancel: CancelToken | None, on_prefill: Callable[[int, int], None] | None = None) -> bool:
    """Run ``prompt[done:-1]`` (L,) through the hidden phase in chunks; False when cancelled.
    ``on_prefill(done, total)`` is called after each chunk."""
    total = prompt.shape[0] - 1
    while total - done > 0:
        n = min(step_size, total - done)
        model.model(prompt[done:done + n][None], cache=cache)  # (1, n) -> hidden, fills the cache
        mx.eval([c.state for c in cache])
        done += n
        if on_prefill is not None:
            on_prefill(done, total)
        if cancel is not None and cancel.cancelled:
            return False
    return True


def _run(model: Any, state: RunState, sampler: Any, limit: int, eos: frozenset[int], prefill_step_size: int,
         cancel: CancelToken | None, start_index: int, pipeline: bool, stats: GenerateStats,
         decode: Any | None, on_prefill: Callable[[int, int], None] | None = None) -> Iterator[TokenEvent]:
    mx.reset_peak_memory()
    cache, prompt_ids = state.cache, state.prompt_ids
    history = list(prompt_ids) if sampler.processors else None
    want_logprobs = sampler.params.logprobs

    def step(y: mx.array, first: bool = False) -> Any:
        stats.forwards += 1
        if decode is not None and not first:
            logits = decode.step(y, cache)  # (1, vocab)
        else:
            logits = model(y[None], cache=cache)[:, -1, :]  # (1, vocab)
        return sampler.step(logits, history or (), state.rng)

    tic = time.perf_counter()
    try:
        if limit <= 0:
            stats.finish_reason = "length"
            return
        prompt = mx.array(prompt_ids, dtype=mx.uint32)
        if not prefill(model, cache, prompt, stats.cached_tokens, prefill_step_size, cancel, on_prefill):
            stats.finish_reason = "cancelled"
            return
        out = step(prompt[-1:], first=True)
        mx.async_eval(out.token)
        n = 0
        decode_tic = tic
        while True:
            next_out = None
            if pipeline and n + 1 < limit:
                next_out = step(out.token)
                mx.async_eval(next_out.token)
            token = int(out.token.item())
            if n == 0:
                decode_tic = time.perf_counter()
                stats.prefill_ms = (decode_tic - tic) * 1e3
            else:
                stats.decode_ms = (time.perf_counter() - decode_tic) * 1e3
            state.tokens.append(token)
            if history is not None:
                history.append(token)
            stats.generated_tokens = n + 1
            finish = token_finish(eos=token in eos, complete=False, count=n + 1, limit=limit,
                                  cancelled=cancel is not None and cancel.cancelled)
            if finish is not None:
                stats.finish_reason = finish
            logprob = top = None
            if want_logprobs:
                logprob = out.token_logprob.item()
                if out.top_ids is not None:
                    top = list(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))  # row 0 of (1, n)
            yield TokenEvent(token=token, index=start_index + n, finish_reason=finish,
                             logprob=logprob, top_logprobs=top)
            if finish is not None:
                return
            n += 1
            out = next_out if next_out is not None else step(out.token)
    except GeneratorExit:
        stats.finish_reason = stats.finish_reason or "cancelled"
        raise
    finally:
        if decode is not None:
            decode.close()
        stats.cache_tokens = max((c.offset for c in cache), default=0)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9


def prompt_ids_for(loaded: "LoadedModel", prompt: str | list[dict[str, Any]], *, chat: bool = False,
                   system: str | None = None) -> list[int]:
    """Token ids for a text prompt (through the chat template when ``chat``) or a message list."""
    if isinstance(prompt, list):
        return loaded.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return loaded.tokenizer.encode(prompt)


def stream_text(loaded: "LoadedModel", tokens: Generation, *, stop: Iterable[str] = (),
                prime_ids: Iterable[int] = ()) -> Generation:
    """Turn a token :class:`Generation` into one whose items carry text, applying stop strings.

    ``prime_ids`` are tokens generated earlier in the same generation (a
    resumed run): they bring the detokenizer and the stop matcher to the state
    they had, so text is neither repeated nor lost, but are not emitted again.
    """
    eos = loaded.eos_token_ids

    def texts() -> Iterator[TokenEvent]:
        out = TextOutput(loaded.tokenizer.detokenizer(), stop)
        out.prime(prime_ids)
        try:
            for t in tokens:
                text, finish = out.feed(t.token, t.finish_reason, eos=t.token in eos)
                stopped = finish == "stop" and t.finish_reason != "stop"
                if stopped:
                    tokens.stats.finish_reason = "stop"
                yield replace(t, text=text, finish_reason=finish)
                if stopped:
                    return
        finally:
            tokens.close()

    return Generation(texts(), tokens.stats, tokens.state)


def newline_ids(loaded: "LoadedModel") -> tuple[int, ...]:
    """Token ids that decode to a bare newline (XTC must not remove them)."""
    found = []
    for text in ("\n", "\n\n"):
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            found.append(ids[0])
    return tuple(found)


def generate(
    loaded: "LoadedModel",
    prompt: str | list[dict[str, Any]],
    *,
    sampling: SamplingParams = GREEDY,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stop: Iterable[str] = (),
    chat: bool = False,
    prefill_step_size: int | None = None,
    cancel: CancelToken | None = None,
    prompt_cache: PromptCache | None = None,
    compiled: bool = True,
    constraint: Any | None = None,
    grammar_jump: bool = True,
    on_prefill: Callable[[int, int], None] | None = None,
    adapter: str | None = None,
) -> Generation:
    """Generate text after ``prompt`` (a string, or chat messages); items carry their text.

    EOS ends the generation and contributes no text; so does a stop string,
    which is excluded from the text. ``compiled`` uses the graph's compiled
    decode step where it has one (same tokens; see ``tests/test_decode_step.py``).
    ``prefill_step_size`` ``None`` takes the binding's prefill policy (workspace-bounded).
    ``constraint`` (a :class:`~mlx_infer.constraints.Constraint`) constrains the text to a JSON
    schema, regex, choice or grammar; ``grammar_jump`` commits the tokens it forces in one forward.
    ``on_prefill``: see :func:`generate_tokens`. ``adapter``: an adapter name in the model's
    bank or an adapter directory (loaded and validated on first use); ``None``: the model's
    default adapter (``load(path, adapter=...)``), if any.
    """
    from .bindings.autoregressive import bind_autoregressive

    if adapter is not None:
        from ..adapters import attach_adapter

        adapter = attach_adapter(loaded.model, adapter)

    ids = prompt_ids_for(loaded, prompt, chat=chat)
    binding = bind_autoregressive(loaded)
    from ..parallel.serve_rank import shared_seed

    if (seed := shared_seed(loaded.model, sampling.seed)) != sampling.seed:  # a sharded graph: one seed for all ranks
        sampling = replace(sampling, seed=seed)
    state = None
    if constraint is not None:
        from ..constraints import ConstraintState

        state = ConstraintState.create(constraint, loaded.tokenizer, loaded.model.args.vocab_size,
                                       loaded.eos_token_ids)
    if prefill_step_size is None:
        prefill_step_size = binding.prefill_policy.chunk_size(len(ids))
    inner = generate_tokens(
        loaded.model, ids, sampling=sampling, max_tokens=max_tokens,
        eos_token_ids=loaded.eos_token_ids, newline_token_ids=newline_ids(loaded),
        context_length=loaded.context_length, prefill_step_size=prefill_step_size, cancel=cancel,
        prompt_cache=prompt_cache, decode=binding.create_decode() if compiled else None,
        constraint=state, grammar_jump=grammar_jump,
        on_prefill=on_prefill, adapter=adapter,
    )
    return stream_text(loaded, inner, stop=stop)
