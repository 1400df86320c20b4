"""Grammar jump in the engine: tokens a constraint forces are committed together, in one forward.

A constrained row's grammar often admits exactly one continuation (a JSON key, punctuation,
the rest of a choice: :meth:`~mlx_infer.constraints.ConstraintState.forced`). Such tokens are
never sampled (no key is drawn; logprob 0, the token its only top entry, ``forced=True``), with
``Composition.grammar_jump`` on or off. What the switch changes is how they reach the KV::

    jump off   t | f1 | f2 | f3 | next      one decode step per forced token (its logits unused)
    jump on    t  f1  f2  f3 -> next        f1..f3 are emitted as soon as t is, and the row
                                            feeds [t, f1, f2, f3] as one short prefill over
                                            its own pages (state PREFILL, ``prefilled`` = the
                                            tokens its pages hold): one forward, the next
                                            token sampled from its last position

The span rides the engine's prefill path (or, with mixed steps, a chunk of the decode step's
plan), so its pages are reserved, preempted and recomputed like any prompt chunk. A span of k
forced tokens saves k row forwards (``grammar_jump_forwards_saved_total``); the token stream,
logprobs and finish reasons are the same with the switch on or off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from ..sampling import SampleOutput
from .scheduler import DECODE, PREFILL, LiveRequest

if TYPE_CHECKING:
    from .engine import Engine


def forced_output(r: LiveRequest) -> SampleOutput | None:
    """The row's next token when its constraint forces it (a :class:`SampleOutput` marked
    ``forced``, shaped like a sampled one of one row), else ``None``: the row samples."""
    if r.constraint is None:
        return None
    forced = r.constraint.forced()
    if not forced:
        return None
    tok = forced[0]
    p = r.request.sampling
    token = mx.array([tok], mx.uint32)  # (1,)
    if not p.logprobs:
        return SampleOutput(token=token, forced=True)
    top = p.top_logprobs > 0
    return SampleOutput(token=token, token_logprob=mx.array([0.0]),  # (1,)
                        top_ids=mx.array([[tok]], mx.int32) if top else None,  # (1, 1)
                        top_logprobs=mx.array([[0.0]]) if top else None, forced=True)


def commit_span(engine: "Engine", r: LiveRequest) -> None:
    """After ``r`` emitted a token: emit every token its grammar now forces (until it leaves the
    model a choice, or the request ends), then make ``r`` feed them as one prefill chunk."""
    p = r.request.sampling
    lp = 0.0 if p.logprobs else None
    span = 0
    while r.state == DECODE:
        forced = r.constraint.forced()
        if not forced:
            break
        for tok in forced:
            span += 1
            engine._emit(r, tok, lp, [(tok, 0.0)] if lp is not None and p.top_logprobs else None,
                         forced=True, jump=False)
            if r.state != DECODE:  # finished (length, a stop string, the grammar complete)
                break
    if span == 0:
        return
    engine.metrics.jumped(span)
    if r.state == DECODE:
        # The pages hold every token but the last span + 1 (the token before the span, not fed yet).
        r.state = PREFILL
        r.prefilled = len(r.all_ids) - span - 1
        r.next_input = None
