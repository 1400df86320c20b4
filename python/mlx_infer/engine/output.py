"""Reading a step's tokens out of the engine: per row, the token, its text, its logprobs and the finish.

The engine thread calls :func:`consume` with the step it queued one iteration earlier (step n-1's tokens are
read while step n runs). Each decoding row's token goes through :func:`emit`: the constraint advances, the
sequence's :class:`~mlx_infer.generation.text_output.TextOutput` (the same finish rule, detokenizer and stop
strings ``generate`` uses) gives the text and the final reason, and the request's handle gets a
:class:`TokenEvent` — or, when the sequence ends, :func:`finish` releases its pages and adapter and delivers the
:class:`RequestResult`. One row's bad value fails that request alone, never the batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..errors import MlxInferError
from ..generation.text_output import TextOutput, token_finish
from .adapters import release_adapter
from .grammar_jump import commit_span
from .request import EngineRequest, RequestResult, TokenEvent, wake
from .scheduler import DECODE, DONE, LiveRequest

if TYPE_CHECKING:
    from .engine import Engine
    from .rows import Step


def text_output(tokenizer: Any, request: EngineRequest) -> TextOutput:
    """The output state machine of ``request``'s text: its detokenizer options and stop strings (the engine's,
    and the server process's for the requests whose text it makes, engine/process.py)."""
    return TextOutput(tokenizer.detokenizer(skip_special_tokens=request.skip_special_tokens,
                                            spaces_between_special_tokens=request.spaces_between_special_tokens),
                      request.stop)


def consume(engine: "Engine", step: "Step") -> None:
    """Emit every decoding row's token of ``step`` (a row cancelled or finished meanwhile is skipped)."""
    # mx.eval waits for the step without the GIL; .tolist() on an unevaluated array would wait holding it,
    # and the server's event loop (another thread) could not stream while the device runs.
    mx.eval(step.tokens, [a for o in step.outs or () if o is not None
                          for a in (o.token_logprob, o.top_ids, o.top_logprobs) if a is not None])
    tokens = step.tokens.tolist()
    now = time.perf_counter()
    n = 0
    gaps: dict[float, int] = {}  # previous token's time -> rows (inter-token latency; a step's rows share few)
    engine._wakeups = {}  # one wake-up per event loop for the whole step
    try:
        for i, r in enumerate(step.rows):
            if r.state != DECODE:
                continue  # cancelled (or finished) while the step ran
            if r.t_first is None:
                r.t_first = now
                engine.metrics.first_token(now - r.t_submit)
            else:
                gaps[r.t_last] = gaps.get(r.t_last, 0) + 1
            r.t_last = now
            n += 1
            try:
                lp = top = None
                out = step.outs[i] if step.outs is not None else None
                if out is not None and out.token_logprob is not None:
                    lp = out.token_logprob[0].item()
                    if out.top_ids is not None:
                        top = list(zip(out.top_ids[0].tolist(), out.top_logprobs[0].tolist()))
                if engine.vocab_size is not None and not 0 <= tokens[i] < engine.vocab_size:
                    raise MlxInferError(f"sampled token id {tokens[i]} is outside the vocabulary")
                emit(engine, r, tokens[i], lp, top, forced=out is not None and out.forced)
            except Exception as e:  # one row's values or text, not the batch: fail that request alone
                finish(engine, r, "error", error=f"{type(e).__name__}: {e}")
    finally:
        wakeups, engine._wakeups = engine._wakeups, None
        if wakeups:
            wake(wakeups)
        if n:
            engine.metrics.generated(n)
        if gaps:
            engine.metrics.inter_token(gaps, now)


def emit(engine: "Engine", r: LiveRequest, token: int, logprob: float | None,
         top: list[tuple[int, float]] | None, *, forced: bool = False, jump: bool = True) -> None:
    """Append ``token`` to ``r``: its text, logprobs and event; finish the request if it ends here.

    ``forced``: the constraint forced the token (not sampled). ``jump``: after it, commit the tokens the grammar
    now forces as one prefill chunk (engine/grammar_jump.py) when the engine's composition allows it.
    """
    r.all_ids.append(token)
    index = r.generated - 1
    eos = token in engine.eos and not r.request.ignore_eos
    done = False
    if r.constraint is not None:
        r.constraint.advance(token, forced=forced)
        done = r.constraint.done  # the grammar is complete: nothing may follow
    reason = token_finish(eos=eos, complete=done, count=r.generated, limit=r.limit)
    text = ""
    if r.request.detokenize:
        text, reason = r.text_out.feed(token, reason, eos=eos)
        r.text.append(text)
    if logprob is not None:
        r.logprobs.append(logprob)
        if top is not None:
            r.top_logprobs.append(top)
    if forced:
        engine.metrics.forced()
    event = TokenEvent(request_id=r.request.request_id, token=token, index=index, text=text, finish_reason=reason,
                       logprob=logprob, top_logprobs=top, forced=forced)
    if reason is None:
        r.handle._deliver(event, wakeups=engine._wakeups)
        if jump and r.constraint is not None and engine.grammar_jump:
            commit_span(engine, r)  # the tokens the grammar forces now, fed as one prefill chunk
    else:
        finish(engine, r, reason, event=event)


def finish(engine: "Engine", r: LiveRequest, reason: str, *, event: TokenEvent | None = None,
           error: str | None = None) -> None:
    """End ``r`` with ``reason``: pages and adapter back now, then its result to the caller (once)."""
    if r.state == DONE:
        return
    engine.scheduler.release(r)  # pages back to the pool now
    release_adapter(engine.model, r)
    r.state = DONE
    r.next_input = None
    with engine._lock:
        engine._live.pop(r.request.request_id, None)
        engine._cancels.discard(r.request.request_id)
    now = time.perf_counter()
    engine.metrics.finished(reason, now - r.t_submit)
    engine._update_gauges()  # before the caller hears of it: /metrics then shows the pages back
    p = r.request.sampling
    result = RequestResult(
        request_id=r.request.request_id, prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens or 0,
        token_ids=r.all_ids[r.prompt_len:], text="".join(r.text), finish_reason=reason,
        logprobs=r.logprobs if p.logprobs else None,
        top_logprobs=r.top_logprobs if p.logprobs and p.top_logprobs else None,
        preemptions=r.preemptions, ttft_ms=((r.t_first or now) - r.t_submit) * 1e3,
        total_ms=(now - r.t_submit) * 1e3, error=error,
        forced_tokens=r.constraint.forced_committed if r.constraint is not None else 0,
        prompt_logprobs=r.handle.prompt_logprobs)
    if event is None:
        event = TokenEvent(request_id=r.request.request_id, token=None, index=r.generated, finish_reason=reason)
    r.handle._deliver(event, result, wakeups=engine._wakeups)
