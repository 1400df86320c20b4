"""The autoregressive generation loop.

``generate_tokens`` works on token ids; ``generate`` adds the tokenizer: it
encodes the prompt (optionally through the chat template) and streams text.

The loop pipelines: step n+1 is queued (``mx.async_eval``) before token n is
handed to the caller, so the device works while Python runs the caller's code.
Prefill runs the prompt, except its last token, through the graph's hidden
phase in chunks (no LM head: the vocabulary projection is only needed for
the last position); the last prompt token is the first decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import mlx.core as mx

from ..errors import MlxInferError, PromptTooLongError
from ..sampling import RequestRNG, sample

if TYPE_CHECKING:
    from ..artifacts.loader import LoadedModel

DEFAULT_MAX_TOKENS = 256
DEFAULT_PREFILL_STEP_SIZE = 2048


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token.

    Attributes:
        token: the token id.
        index: 0 for the first generated token.
        text: the text this token completes (may be empty while a UTF-8
            character is still incomplete; EOS tokens carry no text).
        finish_reason: ``"stop"`` (EOS) or ``"length"`` on the last token, else None.
    """

    token: int
    index: int
    text: str = ""
    finish_reason: str | None = None


@dataclass
class GenerateStats:
    """What a generation cost; settled even when the caller breaks out early."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    cache_tokens: int = 0
    peak_memory_gb: float = 0.0
    finish_reason: str | None = None

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens per second (prefill includes the first decode step)."""
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second after the first one."""
        n = self.generated_tokens - 1
        return n / (self.decode_ms / 1e3) if n > 0 and self.decode_ms > 0 else 0.0


class Generation(Iterator[GeneratedToken]):
    """An iterator of :class:`GeneratedToken`; ``stats`` is final once it ends or is closed.

    Breaking out of a ``for`` loop leaves it suspended; call :meth:`close` (or
    use it as a context manager) to release the KV state at once. It is also
    released when the object is garbage-collected.
    """

    def __init__(self, tokens: Iterator[GeneratedToken], stats: GenerateStats):
        self._tokens = tokens
        self.stats = stats

    def __next__(self) -> GeneratedToken:
        return next(self._tokens)

    def close(self) -> None:
        """Stop generating and release all state."""
        self._tokens.close()  # type: ignore[attr-defined]

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _validate(max_tokens: int, prefill_step_size: int, prompt_len: int, context: int | None) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 0:
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


def generate_tokens(
    model: Any,
    prompt_ids: list[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_token_ids: Iterable[int] = (),
    context_length: int | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
) -> Generation:
    """Generate token ids after ``prompt_ids``.

    Args:
        model: a graph (see :class:`mlx_infer.contracts.Graph`).
        prompt_ids: the prompt's token ids (non-empty).
        max_tokens: the most tokens to generate.
        temperature: 0 is greedy.
        seed: seeds the request's own key sequence (``None``: a fresh seed).
        eos_token_ids: tokens that end the generation (they are yielded, with
            ``finish_reason="stop"``).
        context_length: the model's window; the prompt must fit, and
            generation stops with ``"length"`` when the window is full.
        prefill_step_size: prompt tokens per prefill chunk.

    Returns:
        A :class:`Generation` (iterator of :class:`GeneratedToken` with ``stats``).
    """
    prompt_ids = list(prompt_ids)
    _validate(max_tokens, prefill_step_size, len(prompt_ids), context_length)
    if temperature < 0:
        raise MlxInferError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    rng = RequestRNG(seed)
    stats = GenerateStats(prompt_tokens=len(prompt_ids))
    limit = max_tokens if context_length is None else min(max_tokens, context_length - len(prompt_ids))
    eos = frozenset(eos_token_ids)
    return Generation(_run(model, prompt_ids, limit, max_tokens, temperature, rng, eos, prefill_step_size, stats), stats)


def _run(model: Any, prompt_ids: list[int], limit: int, max_tokens: int, temperature: float,
         rng: RequestRNG, eos: frozenset[int], prefill_step_size: int,
         stats: GenerateStats) -> Iterator[GeneratedToken]:
    mx.reset_peak_memory()
    cache = model.make_cache()
    prompt = mx.array(prompt_ids, dtype=mx.uint32)

    def step(y: mx.array) -> mx.array:
        logits = model(y[None], cache=cache)[:, -1, :]  # (1, vocab)
        return sample(logits, temperature=temperature, rng=rng)

    tic = time.perf_counter()
    try:
        if limit <= 0:
            stats.finish_reason = "length"
            return
        done = 0
        while len(prompt_ids) - 1 - done > 0:
            n = min(prefill_step_size, len(prompt_ids) - 1 - done)
            model.model(prompt[done:done + n][None], cache=cache)
            mx.eval([c.state for c in cache])
            done += n
        y = step(prompt[-1:])
        mx.async_eval(y)
        n = 0
        decode_tic = tic
        while True:
            next_y = step(y) if n + 1 < limit else None
            if next_y is not None:
                mx.async_eval(next_y)
            token = int(y.item())
            if n == 0:
                decode_tic = time.perf_counter()
                stats.prefill_ms = (decode_tic - tic) * 1e3
            else:
                stats.decode_ms = (time.perf_counter() - decode_tic) * 1e3
            stats.generated_tokens = n + 1
            finish = "stop" if token in eos else ("length" if n + 1 >= limit else None)
            if finish is not None:
                stats.finish_reason = finish
            yield GeneratedToken(token=token, index=n, finish_reason=finish)
            if finish is not None:
                return
            n += 1
            y = next_y
    except GeneratorExit:
        stats.finish_reason = stats.finish_reason or "cancelled"
        raise
    finally:
        stats.cache_tokens = max((c.offset for c in cache), default=0)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        del cache


def prompt_ids_for(loaded: "LoadedModel", prompt: str, *, chat: bool = False,
                   system: str | None = None) -> list[int]:
    """Token ids for a text prompt, through the chat template when ``chat``."""
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return loaded.tokenizer.encode(prompt)


def generate(
    loaded: "LoadedModel",
    prompt: str,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    chat: bool = False,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
) -> Generation:
    """Generate text after ``prompt``; each item carries the text it completes.

    EOS ends the generation and contributes no text.
    """
    ids = prompt_ids_for(loaded, prompt, chat=chat)
    inner = generate_tokens(
        loaded.model, ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
        eos_token_ids=loaded.eos_token_ids, context_length=loaded.context_length,
        prefill_step_size=prefill_step_size,
    )

    def texts() -> Iterator[GeneratedToken]:
        detok = loaded.tokenizer.detokenizer()
        try:
            for t in inner:
                if t.token in loaded.eos_token_ids:
                    text = detok.flush()
                else:
                    text = detok.add(t.token)
                    if t.finish_reason is not None:
                        text += detok.flush()
                yield GeneratedToken(token=t.token, index=t.index, text=text, finish_reason=t.finish_reason)
        finally:
            inner.close()

    return Generation(texts(), inner.stats)
