"""Mixed steps: prefill chunks of joining requests ride in the decode step's forward.

One prompt-token budget per step (``EngineConfig.prefill_step_size``, the
same bound on prompt work per iteration as the separate prefill), spent in
admission order after every decoding request's one token, each prefilling
request a chunk of as many tokens as the budget has left (vLLM v1's order)::

    budget 512, 31 decoding rows, a 700-token prompt joining
      step 1   rows 0..30 decode | rows 31..542  prompt tokens 0..511
      step 2   rows 0..30 decode | rows 31..218  prompt tokens 512..699  -> its first token
                                                  (the chunk's last row gets logits)

A chunk of n tokens is n rows of the step plan (same block table, consecutive
positions: ``DecodeBatch(store, seqs, counts)``), so decode never waits for a
whole prompt and the joining request's first token comes from the step that
ends its prompt. Only the decode rows and the last row of each chunk that ends
a prompt get logits (``DecodeBatch.logit_rows``). R is padded to a multiple of
:data:`ROW_BUCKET` and the logit rows to one of :data:`LOGIT_BUCKET`, so the
compiled step sees few shapes (padding rows write and read the null page).

Used only where the step's attention reads K/V through the block tables (the
compiled step's paged-attention kernel); the eager graph gathers every row's
keys, O(chunk x context) memory, so there the engine prefills separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..state.paged import PagedKVStore
from .batch import DecodeBatch
from .host_arrays import host_array
from .metrics import EngineMetrics
from .scheduler import DECODE, PREFILL, LiveRequest, Scheduler

#: A mixed step's rows are rounded up to a multiple of this (padding rows).
ROW_BUCKET = 64
#: Its logit rows are rounded up to a multiple of this (repeats of row 0, dropped after).
LOGIT_BUCKET = 8


@dataclass
class Chunk:
    """``n`` prompt tokens of a prefilling request in a mixed step."""

    r: LiveRequest
    n: int
    ends: bool  # the chunk ends the prompt: its last row gets logits (the first token)


def pick_chunks(running: list[LiveRequest], budget: int) -> list[Chunk]:
    """Prompt chunks of at most ``budget`` tokens in all, in admission order."""
    left = budget
    out: list[Chunk] = []
    for r in running:
        if left <= 0:
            break
        if r.state != PREFILL or r.seq is None:
            continue
        n = min(len(r.all_ids) - r.prefilled, left)
        out.append(Chunk(r, n, r.prefilled + n == len(r.all_ids)))
        left -= n
    return out


def mixed_batch(store: PagedKVStore, rows: list[LiveRequest], chunks: list[Chunk], table_bucket: int) -> DecodeBatch:
    """The step's batch: decode rows first (one token each), then each chunk's rows."""
    return DecodeBatch(store, [r.seq for r in rows] + [c.r.seq for c in chunks],
                       [1] * len(rows) + [c.n for c in chunks], table_bucket=table_bucket, row_bucket=ROW_BUCKET)


def mixed_inputs(decode_inputs: mx.array, batch: DecodeBatch, chunks: list[Chunk]) -> tuple[mx.array, list[LiveRequest]]:
    """The step's ``(R,)`` tokens (decode inputs, chunk ids, padding) and the requests whose
    prompt ends here; sets ``batch.logit_rows`` (decode rows, then those chunks' last rows)."""
    B = decode_inputs.shape[0]
    ids = [t for c in chunks for t in c.r.all_ids[c.r.prefilled:c.r.prefilled + c.n]]
    pad = batch.rows - B - len(ids)
    tokens = mx.concatenate([decode_inputs.astype(mx.uint32), host_array(ids + [0] * pad, mx.uint32)])  # (R,)
    logit_rows = list(range(B))
    ended: list[LiveRequest] = []
    end = B
    for c in chunks:
        end += c.n
        if c.ends:
            logit_rows.append(end - 1)
            ended.append(c.r)
    pad_row = logit_rows[0] if logit_rows else 0  # a step of chunks none of which ends: row 0's, dropped
    logit_rows += [pad_row] * (-len(logit_rows) % LOGIT_BUCKET or (LOGIT_BUCKET if not logit_rows else 0))
    batch.logit_rows = host_array(logit_rows, mx.int32)  # (M padded,)
    return tokens, ended


def advance(chunks: list[Chunk], scheduler: Scheduler, metrics: EngineMetrics) -> None:
    """After a mixed step: the chunks' prompt tokens are in the pages (index them as the
    separate prefill does); a chunk that ended its prompt makes its request decode."""
    windowed = any(g.window is not None for g in scheduler.store.groups)
    for c in chunks:
        c.r.prefilled += c.n
        if c.ends or windowed:
            scheduler.register_prompt(c.r, c.r.prefilled)
        if c.ends:
            c.r.state = DECODE
    metrics.prefilled(sum(c.n for c in chunks))
