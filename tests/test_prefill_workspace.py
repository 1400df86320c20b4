"""Bounded prefill workspace: a 16k- and a 32k-token prompt prefilled over paged
KV in chunks from ``_fast.prefill_chunk_size`` keep their transient memory
under the budget, where one whole-prompt chunk would need far more.

The 32k case is marked slow: its quadratic attention work alone takes ~105 s
on two CPU cores (plain KV caches take as long); 16k takes ~32 s.

Transient = ``mx.get_peak_memory()`` during prefill minus what was live before
(the weights) minus the KV storage (the whole page pool, allocated on the
first write). The model is a tiny llama (hidden 64, 2 layers, 4 heads, 2 KV
heads, head_dim 16) in float32, so attention scores dominate everything else.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_infer._fast import Geometry, prefill_chunk_size, sdpa_fallback_bytes
from mlx_infer.models import get_model_classes
from mlx_infer.state.paged import PagedKVStore

MIB = 1 << 20
BUDGET = 64 * MIB
PAGE_SIZE = 16
CONFIG = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 320,
    "rope_theta": 10000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
}
GEOMETRY = Geometry(n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, dtype_bytes=4)


def prefill(model, caches, tokens: mx.array, chunk: int) -> int:
    """Run ``tokens`` (L,) through the hidden phase in chunks; returns the peak transient bytes."""
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    for start in range(0, tokens.shape[0], chunk):
        model.model(tokens[start:start + chunk][None], cache=caches)  # (1, chunk, hidden)
        mx.eval([c.state for c in caches])
    return mx.get_peak_memory() - before


def test_16k_prefill_stays_within_the_workspace_budget():
    check_prefill(16384, expected_chunk=128)


@pytest.mark.slow
def test_32k_prefill_stays_within_the_workspace_budget():
    check_prefill(32768, expected_chunk=64)


def check_prefill(prompt_tokens: int, expected_chunk: int) -> None:
    model_cls, args_cls = get_model_classes("llama")
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(CONFIG))
    mx.eval(model.parameters())
    store = PagedKVStore.for_model(model, num_pages=prompt_tokens // PAGE_SIZE + 1, page_size=PAGE_SIZE)
    seq = store.add_sequence()
    caches = store.make_cache(seq)
    tokens = mx.random.randint(0, CONFIG["vocab_size"], (prompt_tokens,), key=mx.random.key(1))
    mx.eval(tokens)

    chunk = prefill_chunk_size(GEOMETRY, prompt_tokens, budget_bytes=BUDGET)
    # 4 heads * chunk queries * prompt_tokens keys * (4 + 4) bytes <= 64 MiB
    assert chunk == expected_chunk
    whole = sdpa_fallback_bytes(GEOMETRY, chunk=prompt_tokens, prompt_tokens=prompt_tokens)
    assert whole == 4 * prompt_tokens * prompt_tokens * 8 > 100 * BUDGET  # 8 GiB for one chunk

    transient = prefill(model, caches, tokens, chunk) - store.nbytes
    assert seq.length == prompt_tokens
    assert store.nbytes == 2 * 2 * (prompt_tokens + PAGE_SIZE) * 2 * 16 * 4  # layers, K/V, tokens, heads, dim, f32
    assert 0 < transient < BUDGET, f"transient {transient / MIB:.1f} MiB over the {BUDGET / MIB:.0f} MiB budget"

    # The budget binds: redo the last 512 tokens as one chunk (4x/8x the chosen size), and
    # its measured scores alone (4 heads * 512 * 16384 float32 = 128 MiB at 16k) exceed it.
    assert seq.truncate(512) == 512
    bigger = prefill(model, caches, tokens[-512:], 512)
    assert bigger > BUDGET, f"a 512-token chunk took only {bigger / MIB:.1f} MiB"
    print(f"transient {transient / MIB:.1f} MiB (chunk {chunk}), 4x chunk {bigger / MIB:.1f} MiB, "
          f"budget {BUDGET / MIB:.0f} MiB")
