"""Multi-adapter batched decode (issue 21): 32 streams over 4 LoRA adapters vs no adapter.

    python benchmarks/lora_decode.py --json benchmarks/results/cpu-lora-decode.json

One process, CPU, the tests' tiny llama and gemma3 configs (tests/tiny.py; ``--shapes
270m-width`` widens their layers to Gemma 3 270M's). Two loads of
the same model directory: ``base`` (no adapter bank) and ``lora`` (a bank of 4 random
mlx-lm adapters, rank ``--rank``, on every linear layer of every block: q, k, v, o, gate,
up, down). Each engine serves ``-b`` greedy requests (random ``-p``-token prompts, ``-g``
tokens each, EOS ignored); in ``lora`` request i uses adapter i mod 4, so every step mixes
all four in one compiled paged step. Engines are built once, warmed up by a full run (every
trace happens there), then alternate run by run; rows are medians of ``-n`` runs of decode
tokens/s over the whole batch (prefill excluded, as benchmarks/paged_decode.py); the ratio
is also given as the median of per-trial ratios (the two runs of a trial are adjacent).

Reported per model: both throughputs, their ratio, the step time of each (B / tok/s) and
their difference: the per-step cost of the low-rank products (on the CPU kernels, one
``fast_lora_linear`` per targeted linear in place of its plain product: the layer's product,
each row's own slot's two low-rank products and the add in one op, cpp/cpu_kernels/lora_update.cpp),
beside their arithmetic (multiply-adds per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lora_helpers import make_mlx_adapter  # noqa: E402
from tiny import make_tiny_model_dir  # noqa: E402

from mlx_infer.adapters import attach_adapter, bank_of  # noqa: E402
from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from mlx_infer.engine.scheduler import DECODE  # noqa: E402

#: Model shapes: the tests' tiny configs, and Gemma 3 270M's layer width (hidden 640, MLP 2048,
#: 4 heads of 256, 1 KV head) on the tiny configs' 2-3 layers and 320-token vocabulary.
SHAPES = {
    "tiny": {},
    "270m-width": {"hidden_size": 640, "intermediate_size": 2048, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256},
}
KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
ADAPTERS = 4


def one_run(engine: Engine, prompts: list[list[int]], gen: int, adapters: list[str | None]) -> float:
    """Decode tokens/s of one batch (prefill excluded)."""
    handles = [engine.submit(EngineRequest(prompt_ids=p, max_tokens=gen, ignore_eos=True, detokenize=False,
                                           adapter=a)) for p, a in zip(prompts, adapters)]
    while not all(r.state == DECODE for r in engine.scheduler.running) or len(engine.scheduler.running) < len(prompts):
        engine.step()
    engine._sync()
    mx.synchronize()
    before = sum(len(h._events) for h in handles)
    t0 = time.perf_counter()
    engine.run_until_idle()
    mx.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(h.result(timeout=0).token_ids) for h in handles) - before
    return tokens / dt


def lowrank_macs(model, rank: int, rows: int) -> int:
    """Multiply-adds of the low-rank products per step: rows * sum over targets of r (in + out)."""
    bank = bank_of(model)
    total = 0
    for s in bank.stacks.values():
        _, inp, r = s.a.shape
        out = s.b.shape[2]
        total += rows * r * (inp + out)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--batch", type=int, default=32)
    ap.add_argument("-p", "--prompt", type=int, default=32)
    ap.add_argument("-g", "--gen", type=int, default=64)
    ap.add_argument("-n", "--runs", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--families", nargs="+", default=["llama", "gemma3"])
    ap.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=["tiny"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    rows = []
    for shape, family in [(sh, f) for sh in args.shapes for f in args.families]:
        over = dict(SHAPES[shape])
        if family != "gemma3":
            over.pop("query_pre_attn_scalar", None)
        d = make_tiny_model_dir(root / f"{shape}-{family}", family, **over)
        base = load_model(d)
        lora = load_model(d)
        names = [attach_adapter(lora.model, make_mlx_adapter(d, root / f"{shape}-{family}-a{i}", seed=i, rank=args.rank,
                                                             keys=KEYS), name=f"a{i}") for i in range(ADAPTERS)]
        vocab = base.model.args.vocab_size
        prompts = [rng.integers(5, vocab, size=args.prompt).tolist() for _ in range(args.batch)]
        plan = {"base": (base, [None] * args.batch), "lora": (lora, [names[i % ADAPTERS] for i in range(args.batch)])}
        engines = {}
        for mode, (loaded, adapters) in plan.items():
            e = Engine(loaded, EngineConfig(max_batch=args.batch, prefix_cache=False, page_size=16))
            if e.paged_decode is None:
                raise SystemExit(f"{mode}: no compiled paged step ({e.paged_decode_reason})")
            one_run(e, prompts, args.gen, adapters)  # warm-up: every trace happens here
            engines[mode] = e
        tps: dict[str, list[float]] = {m: [] for m in engines}
        for i in range(args.runs):
            for mode in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
                tps[mode].append(one_run(engines[mode], prompts, args.gen, plan[mode][1]))
        for e in engines.values():
            assert not e.paged_decode.failed, e.paged_decode.last_error
        med = {m: statistics.median(x) for m, x in tps.items()}
        step_ms = {m: 1e3 * args.batch / v for m, v in med.items()}
        row = {
            "model": f"{family}", "shape": shape, "batch": args.batch, "adapters": ADAPTERS, "rank": args.rank,
            "targets_per_layer": len(KEYS), "base_tps": round(med["base"], 1), "lora_tps": round(med["lora"], 1),
            "ratio": round(med["lora"] / med["base"], 3),
            # trial i's two runs are adjacent in time: their ratio shrugs off load drift between trials
            "ratio_per_trial_median": round(statistics.median(l / b for l, b in zip(tps["lora"], tps["base"])), 3),
            "base_runs": [round(x, 1) for x in tps["base"]], "lora_runs": [round(x, 1) for x in tps["lora"]],
            "base_step_ms": round(step_ms["base"], 3), "lora_step_ms": round(step_ms["lora"], 3),
            "lowrank_step_ms": round(step_ms["lora"] - step_ms["base"], 3),
            "lowrank_macs_per_step": lowrank_macs(lora.model, args.rank, args.batch),
            "retraces": engines["lora"].paged_decode.retraces,
        }
        rows.append(row)
        print(f"{shape} {family}: base {row['base_tps']} tok/s, 4 adapters {row['lora_tps']} tok/s "
              f"(x{row['ratio']}, per-trial x{row['ratio_per_trial_median']}); step {row['base_step_ms']} -> {row['lora_step_ms']} ms "
              f"(low-rank products {row['lowrank_step_ms']} ms, {row['lowrank_macs_per_step']:,} MACs)", flush=True)
        for e in engines.values():
            e.stop()
    if args.json:
        args.json.write_text(json.dumps({"prompt": args.prompt, "gen": args.gen, "runs": args.runs,
                                         "mlx": mx.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
