"""The engine's prompt work outside the decode step: the separate prefill forward (the eager
graph, batched where prompts advance together) and allocating the page storage up front.

Where steps mix (engine/mixed.py) prompts ride in the compiled paged step instead; the
separate prefill then serves only what that path cannot (the first forward before the
storage exists, prompt logprobs, a pool too short for a chunk step, the compiled step failed).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import mlx.core as mx

from .adapters import rows_context, slots_for
from .host_arrays import host_array
from .prompt_scores import score_chunk
from .rows import Step, queue_outputs, sample_rows
from .scheduler import DECODE, PREFILL, LiveRequest

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("mlx_infer.engine")


def prefill(engine: "Engine") -> tuple[bool, Step | None]:
    """Up to ``prefill_step_size`` prompt tokens: rows with prompts left advance together by
    the same chunk (one ``(B, n)`` forward), so equal-length prompts prefill as one batch.

    Returns whether it ran anything, and the first tokens of the rows whose prompt ended:
    sampled from the last prompt position of the prefill forward itself (the LM head on
    those rows only), so the first token waits for no decode step.
    """
    budget = engine.config.prefill_step_size
    did = False
    ended: list[tuple[LiveRequest, mx.array]] = []  # rows whose prompt ended, last hidden (hidden,)
    done: set[int] = set()
    head = engine._head
    while budget > 0:
        rows = [r for r in engine.scheduler.running if r.state == PREFILL and id(r) not in done][:budget]
        if not rows:
            break
        end = {id(r): len(r.all_ids) - (0 if head else 1) for r in rows}  # tokens the prefill feeds
        n = min(min(end[id(r)] - r.prefilled for r in rows), max(1, budget // len(rows)))
        if len(rows) > 1:
            batch = engine.store.batch([r.seq for r in rows])
            if not batch.reserve(n):
                rows = rows[:1]  # short of pages: the oldest alone (it may preempt younger ones)
        if len(rows) == 1:
            r = rows[0]
            n = min(budget, end[id(r)] - r.prefilled)
            if not reserve_prefill(engine, r, n):
                break
            caches = r.caches
        else:
            caches = batch.caches
        tokens = host_array([r.all_ids[r.prefilled:r.prefilled + n] for r in rows], mx.uint32)  # (B, n)
        if engine._ceiling is not None:  # bound what the forward holds (engine/activations.py)
            engine._ceiling.engage(n * len(rows), len(rows))
        with rows_context(slots_for(rows)):
            h = engine.model.model(tokens, cache=caches)  # (B, n, hidden): K/V written to pages
        mx.async_eval(h)
        engine.metrics.forward()
        engine.separate_prefills += 1
        score_chunk(engine.model, rows, h, engine.vocab_size)  # prompt logprobs, for the rows that asked
        budget -= n * len(rows)
        did = True
        engine.metrics.prefilled(n * len(rows))
        windowed = any(g.window is not None for g in engine.store.groups)
        for i, r in enumerate(rows):
            r.prefilled += n
            target = end[id(r)]
            if r.prefilled == target or windowed:
                # Windowed layer groups release pages as the prompt grows: index them
                # chunk by chunk, so released ones stay cached for a shorter shared prefix.
                engine.scheduler.register_prompt(r, r.prefilled)
            if r.prefilled == target:
                if head:
                    ended.append((r, h[i, -1]))
                    done.add(id(r))
                else:  # no separate head: the decode step feeds the last prompt token
                    r.state = DECODE
                    r.next_input = r.all_ids[-1]
    if not ended:
        return did, None
    rows = [r for r, _ in ended]
    with rows_context(slots_for(rows)):
        logits = engine.model.logits_from_hidden(mx.stack([x for _, x in ended])[:, None])[:, 0]  # (M, vocab)
    tokens, outs = sample_rows(rows, logits)
    queue_outputs(tokens, outs)
    for i, r in enumerate(rows):
        r.state = DECODE
        r.next_input = (tokens, i)
    return did, Step(rows, tokens, outs)

def reserve_prefill(engine: "Engine", r: LiveRequest, n: int) -> bool:
    """Reserve ``n`` tokens for ``r``, preempting younger requests if pages are short."""
    while not r.seq.reserve(n):
        victim = engine.scheduler.youngest()
        if victim is r and len(engine.scheduler.running) == 1:
            engine._finish(r, "error", error="the KV page pool is too small for this prompt")
            return False
        if victim is r:
            return False  # wait: decoding requests free pages as they finish
        engine._sync()
        engine._preempt(victim)
    return True


def allocate_storage(engine: "Engine") -> None:
    """Create every layer's page storage now, with one eager forward of a throwaway one-token
    sequence, so the first prompt goes through the compiled paged step as every later one
    does (and a warm-up request traces what later requests run). Failing that, the first
    forward allocates it, as before."""
    seq = engine.store.add_sequence()
    try:
        if seq.reserve(1):
            h = engine.model.model(mx.zeros((1, 1), mx.uint32), cache=engine.store.make_cache(seq))  # (1, 1, hidden)
            mx.eval(h, [p for st in engine.store.storage if st is not None for p in st.parts])
    except Exception as e:  # noqa: BLE001 - an optimisation only
        log.warning("could not allocate the KV storage up front (%s: %s)", type(e).__name__, e)
    finally:
        seq.free()
