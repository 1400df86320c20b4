"""A program that exits with an engine still running ends normally: the engine is stopped at exit
(engine.py: _stop_running_engines) before MLX's statics go, which would otherwise abort the process
with "terminate called without an active exception" while the daemon thread is inside MLX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from tiny import make_tiny_model_dir
from pathlib import Path
from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest
from mlx_infer.sampling import SamplingParams
engine = Engine(load_model(make_tiny_model_dir(Path({root!r}), "llama")), EngineConfig(page_size=8)).start()
handle = engine.submit(EngineRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0), max_tokens=4))
print(len(handle.result(timeout=60).token_ids))
engine.submit(EngineRequest(prompt_ids=[4, 5], sampling=SamplingParams(temperature=0.0), max_tokens=10_000,
                            ignore_eos=True))  # still decoding when the program ends
"""


def test_exit_with_a_running_engine_is_clean(tmp_path):
    code = SCRIPT.format(tests=str(Path(__file__).parent), root=str(tmp_path / "m"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "4" and "terminate called" not in done.stderr
