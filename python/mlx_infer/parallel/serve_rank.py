"""``mlx-infer serve`` / ``generate`` on the ranks of a tensor-parallel run.

The HTTP server runs on rank 0 only; every other rank loads its shard, builds
the same engine and follows rank 0's iterations (:func:`.engine_rank.follow`)
until rank 0 stops. ``generate`` runs on every rank (the forward needs them all);
only rank 0 writes to stdout, and a sampling seed left to chance is drawn by rank
0 and shared, so every rank samples the same tokens.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import mlx.core as mx

from .group import ParallelGroup, current_group


def follow_serving(options: Any, make_engine: Any) -> None:
    """A follower rank of ``mlx-infer serve``: load this rank's shard and follow rank 0's engine.

    ``make_engine(options, loaded)`` builds the engine exactly as rank 0's server does (the same
    config and composition: the ranks' schedules must agree).
    """
    from ..artifacts.loader import load_model
    from .engine_rank import follow

    import signal

    # Ctrl-C reaches every rank of a terminal's launch: rank 0 leads the shutdown (drain, then its
    # engine's stop message), so a follower waits for it rather than stopping mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loaded = load_model(options.model)
    follow(make_engine(options, loaded))


def quiet_followers(pg: ParallelGroup | None = None) -> bool:
    """Send a follower's stdout to /dev/null (rank 0 alone prints the text); True on a follower."""
    pg = pg or current_group()
    if not pg.is_leader:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    return not pg.is_leader


def shared_seed(model: Any, seed: int | None) -> int | None:
    """``seed``, or for a sharded graph with none given rank 0's fresh seed, the same on every rank."""
    from .layers import parallel_group_of

    pg = parallel_group_of(model)
    if seed is not None or pg is None:
        return seed
    import secrets

    mine = secrets.randbits(62) if pg.is_leader else 0
    return int(mx.distributed.all_sum(mx.array([mine], mx.int64), group=pg.group).item())


def startup_line(tp: Any) -> str:
    """What a sharded load states: group size, backend, each rank's weight bytes, what is replicated."""
    from .pipeline import PipelineParallel

    if isinstance(tp, PipelineParallel):
        per_rank = ", ".join(f"{b / 2**20:.2f}" for b in tp.rank_bytes)
        return (f"mlx-infer: pipeline parallel over {tp.pg.size} ranks ({tp.pg.backend} backend): weights per rank "
                f"[{per_rank}] MiB ({tp.rank_bytes[0]} bytes on rank 0, which holds layers {tp.start}..{tp.stop - 1}; "
                "the final norm on every rank, the embedding on rank 0 and, when the head is tied, on the last)")
    per_rank = ", ".join(f"{b / 2**20:.2f}" for b in tp.rank_bytes)
    notes = "; ".join(("vocabulary split across ranks" if tp.vocab_parallel else "vocabulary replicated",
                       *tp.notes))
    return (f"mlx-infer: tensor parallel over {tp.pg.size} ranks ({tp.pg.backend} backend): weights per rank "
            f"[{per_rank}] MiB ({tp.rank_bytes[0]} bytes on rank 0; replicated on every rank: "
            f"{tp.replicated_bytes} bytes of norms and unsplit tensors); {notes}")
