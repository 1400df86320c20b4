"""The autoregressive loop under a constraint, with grammar jump.

Each step the grammar either *forces* the next tokens (a JSON key, punctuation, the rest of a
choice: ``ConstraintState.forced``) or leaves the model a choice. Forced tokens are committed
without sampling (no RNG key is used; their logprob is 0 and ``forced=True``). With
``grammar_jump`` (the default) a forced span is fed together with the token before it as one
short prefill over the same KV: one forward for the whole span instead of one decode step per
token. Without it each forced token is one decode step. The tokens, logprobs and RNG draws are
the same either way; ``stats.forwards`` counts the forwards run.

The allowed-token mask of a sampled step is computed on the host while the device runs the
step's forward (the forward is queued first), then applied on the device before the
processors (the sampler's constraint stage). When the grammar is complete and admits nothing
more, the generation ends with ``finish_reason="stop"`` on its last token, with no EOS forward.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator

import mlx.core as mx

from .stopping import CancelToken
from .text_output import TokenEvent, token_finish

if TYPE_CHECKING:
    from ..constraints import ConstraintState
    from .autoregressive import GenerateStats, RunState


def run_constrained(model: Any, state: "RunState", sampler: Any, limit: int, eos: frozenset[int],
                    prefill_step_size: int, cancel: CancelToken | None, start_index: int,
                    stats: "GenerateStats", decode: Any | None, constraint: "ConstraintState",
                    grammar_jump: bool, on_prefill: Any | None = None) -> Iterator[TokenEvent]:
    """The token stream of a constrained generation (see the module docstring)."""
    from .autoregressive import prefill

    mx.reset_peak_memory()
    cache, prompt_ids = state.cache, state.prompt_ids
    history = list(prompt_ids) if sampler.processors else None
    want_logprobs = sampler.params.logprobs
    top_n = sampler.params.top_logprobs if want_logprobs else 0

    def forward(feed: list[int]) -> mx.array:
        stats.forwards += 1
        y = mx.array(feed, dtype=mx.uint32)  # (L,)
        if len(feed) == 1 and decode is not None and stats.forwards > 1:
            return decode.step(y, cache)  # (1, vocab); the plain caches then hold the token
        if len(feed) == 1:
            return model(y[None], cache=cache)[:, -1, :]  # (1, vocab)
        hidden = model.model(y[None], cache=cache)  # (1, L, hidden): the LM head only for the span's last position
        return model.logits_from_hidden(hidden[:, -1:, :])[:, -1, :]  # (1, vocab)

    tic = time.perf_counter()
    decode_tic = tic
    n = 0  # tokens emitted

    def emit(token: int, finish: str | None, forced: bool, out: Any = None) -> TokenEvent:
        nonlocal n, decode_tic
        if n == 0:
            decode_tic = time.perf_counter()
            stats.prefill_ms = (decode_tic - tic) * 1e3
        else:
            stats.decode_ms = (time.perf_counter() - decode_tic) * 1e3
        state.tokens.append(token)
        if history is not None:
            history.append(token)
        stats.generated_tokens = n + 1
        if forced:
            stats.forced_tokens += 1
        if finish is not None:
            stats.finish_reason = finish
        logprob = top = None
        if want_logprobs:
            if forced:
                logprob, top = 0.0, ([(token, 0.0)] if top_n else None)
            else:
                logprob = out.token_logprob.item()
                if out.top_ids is not None:
                    top = list(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))  # row 0 of (1, n)
        item = TokenEvent(token=token, index=start_index + n, finish_reason=finish,
                          logprob=logprob, top_logprobs=top, forced=forced)
        n += 1
        return item

    def finish_for(token: int) -> str | None:
        return token_finish(eos=token in eos, complete=constraint.done, count=n + 1, limit=limit,
                            cancelled=cancel is not None and cancel.cancelled)

    try:
        if limit <= 0:
            stats.finish_reason = "length"
            return
        prompt = mx.array(prompt_ids, dtype=mx.uint32)
        if not prefill(model, cache, prompt, stats.cached_tokens, prefill_step_size, cancel, on_prefill):
            stats.finish_reason = "cancelled"
            return
        feed = [prompt_ids[-1]]  # committed tokens the KV does not hold yet
        while True:
            forced = constraint.forced()
            if forced:
                take = forced[: limit - n] if grammar_jump else forced[:1]
                for tok in take:
                    if not grammar_jump:  # one decode step per forced token
                        mx.async_eval(forward(feed))
                        feed = []
                    constraint.advance(tok, forced=True)
                    finish = finish_for(tok)
                    yield emit(tok, finish, True)
                    if finish is not None:
                        return
                    feed.append(tok)
                continue  # the grammar may force more after the span; else the model chooses
            logits = forward(feed)  # (1, vocab), queued
            mx.async_eval(logits)
            bits = constraint.bitmask()  # (1, words): host work overlapping the forward
            out = sampler.step(logits, history or (), state.rng, bitmask=bits)
            token = int(out.token.item())
            constraint.advance(token)
            finish = finish_for(token)
            yield emit(token, finish, False, out)
            if finish is not None:
                return
            feed = [token]
    except GeneratorExit:
        stats.finish_reason = stats.finish_reason or "cancelled"
        raise
    finally:
        if decode is not None:
            decode.close()
        stats.cache_tokens = max((c.offset for c in cache), default=0)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
