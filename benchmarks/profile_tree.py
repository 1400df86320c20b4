"""Where a process tree's Python time goes, from py-spy's raw (collapsed-stack) output.

    py-spy record -r 100 -f raw --subprocesses -o /tmp/http.txt -- \\
        python benchmarks/served.py --shape gemma3-270m --streams 32 --http --http-beside --no-ids ...
    python benchmarks/profile_tree.py /tmp/http.txt --top 15

For each process (the served benchmark, the HTTP server, its engine process, the client workers) the samples
it took, then its frames by self samples and by inclusive samples: what the HTTP server spends its event loop
on per token, beside the engine. Frames are ``function (file:line)`` as py-spy names them.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def fold(path: Path) -> dict[str, dict[str, collections.Counter]]:
    """Per process (the innermost ``process ...`` frame of a stack): samples, self and inclusive frame counts."""
    out: dict[str, dict[str, collections.Counter]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        at = max(i for i, f in enumerate(frames) if f.startswith("process "))  # py-spy nests children's stacks
        proc, own = frames[at], frames[at + 1:]
        d = out.setdefault(proc, {"samples": collections.Counter(), "self": collections.Counter(),
                                  "inclusive": collections.Counter()})
        n = int(count)
        d["samples"]["all"] += n
        if own:
            d["self"][own[-1]] += n
            for f in set(own):
                d["inclusive"][f] += n
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", type=Path, help="py-spy record -f raw output")
    p.add_argument("--top", type=int, default=12, help="frames listed per process and kind")
    p.add_argument("--processes", type=int, default=5, help="processes listed, most samples first")
    args = p.parse_args()
    procs = fold(args.raw)
    for proc, d in sorted(procs.items(), key=lambda kv: -kv[1]["samples"]["all"])[:args.processes]:
        print(f"== {d['samples']['all']} samples: {proc[:120]}")
        for kind in ("self", "inclusive"):
            print(f"  {kind}:")
            for frame, n in d[kind].most_common(args.top):
                print(f"    {n:>6}  {frame[:130]}")


if __name__ == "__main__":
    main()
