"""Host time per engine decode step: what the step costs besides waiting for the device.

    python benchmarks/host_step.py --streams 32,64          # tiny llama (tests/tiny.py), CPU or GPU
    python benchmarks/host_step.py --shape llama-1b --streams 8,32   # random weights of a real shape (GPU)
    python benchmarks/host_step.py --shape llama-1b --streams 32 --ab MLX_INFER_GEMV_ROWS=64 --interleave 10 \
        --rounds 20   # an A/B: both arms' engines live, 20 pairs of 10-step blocks alternating

B greedy requests (16-token prompts, or ``--prompt N``, ids only, EOS ignored) decode together;
after they all decode, 100 engine iterations are timed one by one. Per step:
wall time of ``Engine.step()`` = host time + time inside MLX's evaluation
calls (``mx.async_eval``, and ``mx.eval`` of the previous step's tokens before
the engine reads them, which is the wait for the device). Host time is the
Python scheduling, the step plan (C++), building the step's graph and
handing the tokens out; "submit" is the time inside ``mx.async_eval`` (MLX
encoding the step's kernels: on CUDA its graph nodes and launches), "wait"
the time inside ``mx.eval`` of the tokens. Medians are printed. ``--census`` also prints the
nodes of one decode step's graph by primitive (from ``mx.export_to_dot`` of what the engine hands
``mx.async_eval``): what MLX encodes a step, kernel launches and views alike. On a real
shape the wall time is the device's step when the host keeps up, and host +
submit when it does not (the device then idles between steps). On a GPU with a tiny shape the
device time is negligible and the wall time is the host time; on a shared
2-core CPU the device work competes for the same cores, so compare host times.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny import make_tiny_model_dir  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from mlx_infer.engine.scheduler import DECODE  # noqa: E402

IN_EVAL = [0.0, 0.0]  # seconds inside mx.async_eval (submit), inside mx.eval of the tokens (wait)
_ASYNC = mx.async_eval


CENSUS: dict = {"armed": False, "counts": None}


def _arrays(x) -> list[mx.array]:
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for y in x for a in _arrays(y)]
    if isinstance(x, dict):
        return [a for y in x.values() for a in _arrays(y)]
    return []


def step_census(outputs: list[mx.array]) -> collections.Counter:
    """The primitives of the unevaluated graph behind ``outputs``, counted by name."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = f.read()
    return collections.Counter(re.findall(r'label ?="([A-Za-z_0-9]+)"', text))


def _timed_async_eval(*args, **kwargs):
    if CENSUS["armed"]:
        CENSUS["armed"] = False
        CENSUS["counts"] = step_census(_arrays(args))
    t = time.perf_counter()
    out = _ASYNC(*args, **kwargs)
    IN_EVAL[0] += time.perf_counter() - t
    return out


PROMPT = [16]  # prompt tokens per request (--prompt): the context the timed steps attend over


def _prompt(i: int, vocab: int) -> list[int]:
    return [(7 * i + j) % (vocab - 10) + 5 for j in range(PROMPT[0])]


def _config(B: int, default_pool: bool) -> EngineConfig:
    """The engine's pool: sized from the device for a real shape or a long prompt, else B * 16 pages."""
    if default_pool or PROMPT[0] > 16:
        return EngineConfig(max_batch=B)
    return EngineConfig(max_batch=B, num_pages=B * 16 + 1)


def measure(loaded, B: int, steps: int = 100, vocab: int = 300, default_pool: bool = False,
            census: bool = False) -> dict[str, float]:
    config = _config(B, default_pool)
    engine = Engine(loaded, config)
    consume = engine._consume

    def timed_consume(step):  # the wait for the device: evaluate the tokens before reading them
        t = time.perf_counter()
        mx.eval(step.tokens)
        IN_EVAL[1] += time.perf_counter() - t
        consume(step)

    engine._consume = timed_consume
    prompts = [_prompt(i, vocab) for i in range(B)]
    for _ in range(2):  # the first round traces the step's shapes
        for p in prompts:
            engine.submit(EngineRequest(prompt_ids=p, max_tokens=steps + 40, ignore_eos=True, detokenize=False))
        while not (len(engine.scheduler.running) == B and all(r.state == DECODE for r in engine.scheduler.running)):
            engine.step()
        walls, hosts, submits, waits = [], [], [], []
        CENSUS["armed"] = census
        for _ in range(steps):
            IN_EVAL[0] = IN_EVAL[1] = 0.0
            t = time.perf_counter()
            engine.step()
            w = time.perf_counter() - t
            walls.append(w)
            hosts.append(w - IN_EVAL[0] - IN_EVAL[1])
            submits.append(IN_EVAL[0])
            waits.append(IN_EVAL[1])
        engine.run_until_idle()
    engine.stop()
    med = lambda v: statistics.median(v) * 1e3  # noqa: E731
    return {"streams": B, "wall_ms": med(walls), "host_ms": med(hosts), "eval_ms": med(walls) - med(hosts),
            "submit_ms": med(submits), "wait_ms": med(waits), "compiled": engine.paged_decode is not None}


def ab_rounds(loaded, streams: list[int], switch: str, rounds: int, vocab: int, default_pool: bool) -> None:
    """Unset / set ``switch`` (VAR=VALUE) in turn, ``rounds`` times per stream count, one engine each."""
    var, value = switch.split("=", 1)
    for B in streams:
        runs: dict[str, list[dict[str, float]]] = {"unset": [], switch: []}
        for i in range(rounds):
            for label in runs:
                os.environ.pop(var, None)
                if label != "unset":
                    os.environ[var] = value
                r = measure(loaded, B, vocab=vocab, default_pool=default_pool)
                runs[label].append(r)
                print(f"streams {B:>3} round {i} {label:>24}: step {r['wall_ms']:.3f} ms (host {r['host_ms']:.3f}, "
                      f"submit {r['submit_ms']:.3f}, wait {r['wait_ms']:.3f})", flush=True)
        os.environ.pop(var, None)
        for label, rs in runs.items():
            print(f"streams {B:>3} median {label:>24}: step "
                  f"{statistics.median(r['wall_ms'] for r in rs):.3f} ms (host "
                  f"{statistics.median(r['host_ms'] for r in rs):.3f}, submit "
                  f"{statistics.median(r['submit_ms'] for r in rs):.3f})", flush=True)


class Steady:
    """An engine with B requests all decoding, stepped from this thread: :meth:`block` times K steps."""

    def __init__(self, loaded, B: int, steps: int, vocab: int, default_pool: bool):
        config = _config(B, default_pool)
        self.engine = engine = Engine(loaded, config)
        consume = engine._consume

        def timed_consume(step):  # as measure()'s: the wait for the device is the eval of the tokens
            t = time.perf_counter()
            mx.eval(step.tokens)
            IN_EVAL[1] += time.perf_counter() - t
            consume(step)

        engine._consume = timed_consume
        for i in range(B):
            engine.submit(EngineRequest(prompt_ids=_prompt(i, vocab), max_tokens=steps + 40, ignore_eos=True, detokenize=False))
        while not (len(engine.scheduler.running) == B and all(r.state == DECODE for r in engine.scheduler.running)):
            engine.step()
        self.block(8)  # the steady step's shapes traced

    def block(self, k: int) -> list[tuple[float, float, float]]:
        """(wall, host, submit) seconds of each of ``k`` steps; the last step's tokens read before returning
        (untimed), so the next block -- maybe another engine's -- starts on an idle device."""
        out = []
        for _ in range(k):
            IN_EVAL[0] = IN_EVAL[1] = 0.0
            t = time.perf_counter()
            self.engine.step()
            w = time.perf_counter() - t
            out.append((w, w - IN_EVAL[0] - IN_EVAL[1], IN_EVAL[0]))
        self.engine._sync()
        return out

    def close(self) -> None:
        self.engine.run_until_idle()
        self.engine.stop()


def ab_interleaved(loaded, streams: list[int], switch: str, blocks: int, k: int, vocab: int,
                   default_pool: bool) -> None:
    """Both arms' engines live at once (each built and traced with ``switch`` unset / set), stepped in blocks
    of ``k`` steps, A B B A ..., ``blocks`` pairs: a slow spell of the host lands on both arms alike, where
    ab_rounds' one arm per measurement can catch it alone."""
    pairs = [item.split("=", 1) for item in switch.split(",")]  # one switch may set several variables

    def env(on: bool) -> None:
        for var, value in pairs:
            os.environ.pop(var, None)
            if on:
                os.environ[var] = value

    for B in streams:
        arms = {}
        for on in (False, True):
            env(on)
            arms[on] = Steady(loaded, B, blocks * k + 16, vocab, default_pool)
        times: dict[bool, list] = {False: [], True: []}
        ratios = []
        for i in range(blocks):
            block = {}
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                env(on)
                block[on] = arms[on].block(k)
                times[on] += block[on]
            ratios.append(statistics.median(w for w, _, _ in block[True])
                          / statistics.median(w for w, _, _ in block[False]))
        env(False)
        for on in (False, True):
            arms[on].close()
            med = [statistics.median(t[j] for t in times[on]) * 1e3 for j in range(3)]
            print(f"streams {B:>3} interleaved {switch if on else 'unset':>24}: step {med[0]:.3f} ms (host "
                  f"{med[1]:.3f}, submit {med[2]:.3f}; {len(times[on])} steps)", flush=True)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"streams {B:>3} interleaved set/unset step ratio per block: median {statistics.median(ratios):.3f} "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {blocks} blocks of {k} steps)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="32,64")
    p.add_argument("--family", default="llama", choices=["llama", "gemma3"])
    p.add_argument("--shape", default=None, help="random bf16 weights of this real shape (served.py's) instead")
    p.add_argument("--census", action="store_true", help="print one decode step's graph nodes by primitive")
    p.add_argument("--ab", action="append", default=None, metavar="VAR=VALUE",
                   help="an A/B of an environment switch read at each graph build (MLX_INFER_GEMV_ROWS=0): "
                        "per stream count, --rounds measurements unset and set, alternating, and their medians; "
                        "repeat it for several A/Bs over the one loaded model; with --interleave, VAR=V,VAR2=W "
                        "sets several variables as one switch")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--interleave", type=int, default=0, metavar="K",
                   help="with --ab: both arms' engines live at once, stepped in alternating blocks of K steps "
                        "(--rounds block pairs): the A/B that a slow spell of the host cannot bias")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per request (served.py's -p: 512)")
    args = p.parse_args()
    PROMPT[0] = args.prompt
    mx.async_eval = _timed_async_eval
    root = Path(tempfile.mkdtemp())
    if args.shape:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from served_models import shape_dir

        loaded, name = load_model(shape_dir(args.shape, False, root)), args.shape
    else:
        loaded, name = load_model(make_tiny_model_dir(root / args.family, args.family)), f"tiny {args.family}"
    vocab = loaded.model.args.vocab_size
    print(f"device {mx.default_device()}, {name}")
    for switch in args.ab or []:
        if args.interleave:
            ab_interleaved(loaded, [int(s) for s in args.streams.split(",")], switch, args.rounds, args.interleave,
                           vocab, bool(args.shape))
        else:
            ab_rounds(loaded, [int(s) for s in args.streams.split(",")], switch, args.rounds, vocab,
                      bool(args.shape))
    if args.ab and not args.census:  # with --census, the default arm's census and split follow the A/Bs
        return
    for B in (int(s) for s in args.streams.split(",")):
        r = measure(loaded, B, vocab=vocab, default_pool=bool(args.shape), census=args.census)
        print(f"streams {B:>3}: step {r['wall_ms']:.3f} ms = host {r['host_ms']:.3f} ms + in MLX eval "
              f"{r['eval_ms']:.3f} ms (submit {r['submit_ms']:.3f}, wait {r['wait_ms']:.3f}; "
              f"compiled step: {r['compiled']})", flush=True)
        if args.census and CENSUS["counts"] is not None:
            c = CENSUS["counts"]
            print(f"  step graph: {sum(c.values())} nodes: " + ", ".join(f"{k} {n}" for k, n in c.most_common()),
                  flush=True)


if __name__ == "__main__":
    main()
