"""Which chunk-only mixed steps fail on CUDA (tiny llama shapes): prompts x tokens, attention kind, head dim.

    python benchmarks/gpu_chunk_probe.py      # prints one line per case: ok / the error
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mlx.core as mx  # noqa: E402
from tiny import make_tiny_model_dir  # noqa: E402

from mlx_infer.artifacts.loader import load_model  # noqa: E402
from mlx_infer.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from mlx_infer.generation.bindings.paged_decode_step import PagedDecodePolicy  # noqa: E402

tmp = Path(tempfile.mkdtemp())
loaded = load_model(make_tiny_model_dir(tmp / "llama", "llama"))
for attention, budget in (("kernel", 2048), ("kernel", 512)):
    for n, plen in ((4, 16), (16, 16), (32, 16), (64, 16), (8, 128), (60, 17), (64, 32)):
        eng = Engine(loaded, EngineConfig(max_batch=n, num_pages=n * 16 + 1, mixed_steps=True,
                                          prefill_step_size=budget),
                     decode_policy=PagedDecodePolicy(attention=attention))
        try:
            hs = [eng.submit(EngineRequest(prompt_ids=[(7 * i + j) % 300 + 5 for j in range(plen)], max_tokens=3,
                                           ignore_eos=True, detokenize=False)) for i in range(n)]
            eng.run_until_idle()
            res = [h.result(5).finish_reason for h in hs]
            print(attention, budget, n, plen, "ok", eng.mixed_steps, eng.separate_prefills, set(res), flush=True)
        except Exception as e:  # noqa: BLE001
            print(attention, budget, n, plen, "FAIL", type(e).__name__, str(e)[:160], flush=True)
        mx.synchronize()
