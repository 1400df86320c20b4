"""Head-to-head benchmarks: mlx-infer against mlx-lm (and llama.cpp where installed).

Every engine is timed by the same code, the same way: TTFT is the wall time
until the first generated token exists; decode tokens/s counts the tokens after
the first over the time after the first. Engines alternate trial by trial
(A B A B ...) so drift in the machine hits all of them alike.
"""

from .engines import ENGINES, BenchEngine, TrialResult, make_engine
from .report import RESULTS_SCHEMA_KEYS, results_document, write_markdown, write_plot
from .runner import BenchConfig, run_bench

__all__ = ["ENGINES", "BenchEngine", "TrialResult", "make_engine", "BenchConfig", "run_bench",
           "results_document", "write_markdown", "write_plot", "RESULTS_SCHEMA_KEYS"]
