"""A step's rows in and out: the token inputs of the rows, their sampling, and starting the
evaluation of what the engine will read back (no model, no pages here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..sampling import SampleOutput
from .grammar_jump import forced_output
from .host_arrays import host_array
from .scheduler import LiveRequest


@dataclass
class Step:
    """The rows of one forward and its lazily computed tokens (and sampler outputs)."""

    rows: list[LiveRequest]
    tokens: mx.array  # (B,) uint32
    outs: list[SampleOutput | None] | None


def step_inputs(rows: list[LiveRequest]) -> mx.array:
    """The rows' next tokens: slices of earlier steps' lazy outputs, or host ints."""
    first = rows[0].next_input
    if isinstance(first, tuple) and first[0].shape[0] == len(rows) and all(
            isinstance(r.next_input, tuple) and r.next_input[0] is first[0] and r.next_input[1] == i
            for i, r in enumerate(rows)):
        return first[0]  # the same rows as last step: feed its output as is
    pieces: list[mx.array] = []
    host: list[int] = []
    run: list[Any] = []  # [array, start, stop] of consecutive rows of one array
    for r in rows:
        ni = r.next_input
        if isinstance(ni, tuple) and run and run[0] is ni[0] and run[2] == ni[1]:
            run[2] += 1
            continue
        if run:
            pieces.append(run[0][run[1]:run[2]])
            run = []
        if isinstance(ni, tuple):
            if host:
                pieces.append(host_array(host, mx.uint32))
                host = []
            run = [ni[0], ni[1], ni[1] + 1]
        else:
            host.append(int(ni))
    if run:
        pieces.append(run[0][run[1]:run[2]])
    if host:
        pieces.append(host_array(host, mx.uint32))
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)


def sample_rows(rows: list[LiveRequest], logits: mx.array) -> tuple[mx.array, list | None]:
    """Each row with its own sampler and key sequence; rows whose token is the argmax of their
    (masked) logits share one argmax over the batch.

    Those are the ``simple`` rows and the constrained rows sampling greedily without processors
    or logprobs (:attr:`~mlx_infer.sampling.Sampler.argmax_only`): the batch's masks are applied
    in one op, so one argmax gives each of them exactly what its own sampler would. Rows the
    grammar forces take the forced token (host ints); the others call their sampler on their row.
    """
    if all(r.simple for r in rows):
        return mx.argmax(logits, axis=-1), None  # (B,) uint32
    # A token the grammar forces is committed, not sampled (no key drawn; engine/grammar_jump.py).
    forced = [None if r.simple else forced_output(r) for r in rows]
    masked = [r.constraint if f is None else None for r, f in zip(rows, forced)]
    if any(c is not None for c in masked):  # the batch's masks, in parallel, while the forward runs
        from ..constraints import apply_bitmask, fill_bitmasks

        mx.async_eval(logits)
        bits = fill_bitmasks(masked)  # (B, words): unconstrained rows allow everything
        # The sampler's first stage (the constraint), for the whole batch in one op on the device.
        logits = apply_bitmask(logits, bits)  # (B, vocab)
    b = len(rows)
    outs: list[SampleOutput | None] = []
    sampled: list[mx.array] = []  # (1,) uint32 tokens of the rows their own sampler served
    host: list[int] = []  # the forced tokens
    where: list[tuple[int, int]] = []  # per row: (0, its argmax row) | (1, its sampled) | (2, its forced)
    for i, r in enumerate(rows):
        f = forced[i]
        if f is not None:
            where.append((2, len(host)))
            host.append(r.constraint.forced()[0])
            outs.append(f)
        elif r.simple or r.sampler.argmax_only:
            where.append((0, i))
            outs.append(None)
        else:
            out = r.sampler.step(logits[i:i + 1], r.all_ids if r.needs_history else (), r.rng)
            where.append((1, len(sampled)))
            sampled.append(out.token if out.token.dtype == mx.uint32 else out.token.astype(mx.uint32))
            outs.append(out)
    argmax_rows = any(k == 0 for k, _ in where)
    greedy = [mx.argmax(logits, axis=-1)] if argmax_rows else []  # (B,) uint32: every row's masked argmax
    if not sampled and not host:
        return greedy[0], outs
    offset = (0, b if argmax_rows else 0, (b if argmax_rows else 0) + len(sampled))
    pool = mx.concatenate([*greedy, *sampled, *([host_array(host, mx.uint32)] if host else [])])  # (B + S + F,)
    return pool[host_array([offset[k] + j for k, j in where], mx.int32)], outs  # (B,) uint32


def queue_outputs(tokens: mx.array, outs: list[SampleOutput | None] | None) -> None:
    """Start evaluating a step's tokens (and logprobs) without waiting."""
    pending = [tokens]
    for o in outs or ():
        if o is not None and o.token_logprob is not None:
            pending += [o.token_logprob] + ([o.top_ids, o.top_logprobs] if o.top_ids is not None else [])
    mx.async_eval(pending)
