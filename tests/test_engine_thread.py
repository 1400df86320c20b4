"""The engine thread evaluates a graph whose load left lazy non-parameter arrays (llama3 RoPE's
frequency table): the engine materializes them on the thread that built it."""

from tiny import make_tiny_model_dir

from mlx_infer.artifacts.loader import load_model
from mlx_infer.engine import Engine, EngineConfig, EngineRequest

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def test_llama3_rope_model_serves_from_the_engine_thread(tmp_path):
    loaded = load_model(make_tiny_model_dir(tmp_path / "llama3", "llama", rope_scaling=LLAMA3_ROPE))
    with Engine(loaded, EngineConfig(page_size=4)) as engine:
        (result,) = engine.generate([EngineRequest(prompt_ids=[5, 6, 7, 8, 9], max_tokens=4, detokenize=False,
                                                   ignore_eos=True)], timeout=60)
    assert result.finish_reason == "length" and len(result.token_ids) == 4, result.error
