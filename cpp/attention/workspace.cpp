// SDPA workspace and KV sizing: the numbers the prefill policy and the
// scheduler decide with.
#include "mlx_infer/attention.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace mlx_infer {

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// Saturating: a workspace past int64 is "too big" all the same, and a
// wrapped product would read as small.
int64_t mul_sat(int64_t a, int64_t b) {
  if (a == 0 || b == 0) {
    return 0;
  }
  return a > kMax / b ? kMax : a * b;
}

int64_t add_sat(int64_t a, int64_t b) {
  return a > kMax - b ? kMax : a + b;
}

int window_of(const Geometry& g, int layer) {
  return g.layer_windows.empty() ? 0 : g.layer_windows[layer];
}

void bad(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string("[") + fn + "] " + what);
}

// KV bytes one layer stores per token (K and V).
int64_t layer_token_bytes(const Geometry& g, int kv_bits, int group_size, const char* fn) {
  int64_t per_head;
  if (kv_bits == 16 || kv_bits == 32) {
    per_head = int64_t{g.head_dim} * (kv_bits / 8);
  } else if (kv_bits == 2 || kv_bits == 3 || kv_bits == 4 || kv_bits == 5 ||
             kv_bits == 6 || kv_bits == 8) {
    if (group_size <= 0 || g.head_dim % group_size != 0) {
      bad(fn, "head_dim " + std::to_string(g.head_dim) + " must be a multiple "
          "of group_size " + std::to_string(group_size) + " for quantized KV.");
    }
    // MLX packs quantized values into uint32 words; scales and biases keep
    // the activation dtype.
    const int64_t packed = int64_t{g.head_dim} * kv_bits / 8;
    const int64_t groups = g.head_dim / group_size;
    per_head = packed + groups * 2 * g.dtype_bytes;
  } else {
    bad(fn, "kv_bits must be one of 2, 3, 4, 5, 6, 8 (quantized) or 16, 32 "
        "(plain); got " + std::to_string(kv_bits) + ".");
  }
  return 2 * int64_t{g.n_kv_heads} * per_head;
}

}  // namespace

void validate_geometry(const Geometry& g, const char* fn) {
  auto positive = [&](int v, const char* name) {
    if (v <= 0) {
      bad(fn, std::string(name) + " must be positive, got " + std::to_string(v) + ".");
    }
  };
  positive(g.n_heads, "n_heads");
  positive(g.n_kv_heads, "n_kv_heads");
  positive(g.head_dim, "head_dim");
  positive(g.n_layers, "n_layers");
  positive(g.dtype_bytes, "dtype_bytes");
  if (g.n_heads % g.n_kv_heads != 0) {
    bad(fn, "n_heads (" + std::to_string(g.n_heads) + ") must be a multiple of "
        "n_kv_heads (" + std::to_string(g.n_kv_heads) + ").");
  }
  if (!g.layer_windows.empty() &&
      static_cast<int>(g.layer_windows.size()) != g.n_layers) {
    bad(fn, "layer_windows must be empty (all global) or have one entry per "
        "layer: got " + std::to_string(g.layer_windows.size()) + " for " +
        std::to_string(g.n_layers) + " layers.");
  }
  for (int w : g.layer_windows) {
    if (w < 0) {
      bad(fn, "layer_windows entries must be >= 0 (0 = global), got " +
          std::to_string(w) + ".");
    }
  }
}

int64_t sdpa_fallback_bytes(const Geometry& g, int64_t chunk, int64_t prompt_tokens) {
  const char* fn = "sdpa_fallback_bytes";
  validate_geometry(g, fn);
  if (chunk <= 0) {
    bad(fn, "chunk must be positive, got " + std::to_string(chunk) + ".");
  }
  if (prompt_tokens < 0) {
    bad(fn, "prompt_tokens must be >= 0, got " + std::to_string(prompt_tokens) + ".");
  }
  const int64_t queries = std::min(chunk, prompt_tokens);
  // Scores bounded as float32 even for bf16 inputs, plus the softmax output.
  const int64_t bytes_per_score = 4 + g.dtype_bytes;
  int64_t worst = 0;
  for (int layer = 0; layer < g.n_layers; ++layer) {
    const int w = window_of(g, layer);
    // A windowed layer attends to its window plus the chunk being written.
    const int64_t keys = w > 0 ? std::min(prompt_tokens, add_sat(w, chunk)) : prompt_tokens;
    const int64_t bytes = mul_sat(
        mul_sat(mul_sat(g.n_heads, queries), keys), bytes_per_score);
    worst = std::max(worst, bytes);
  }
  return worst;
}

int prefill_chunk_size(
    const Geometry& g, int64_t prompt_tokens, int64_t budget_bytes, int explicit_chunk) {
  const char* fn = "prefill_chunk_size";
  validate_geometry(g, fn);
  if (explicit_chunk < 0) {
    bad(fn, "explicit chunk must be positive (or 0 for automatic), got " +
        std::to_string(explicit_chunk) + ".");
  }
  if (explicit_chunk > 0) {
    return explicit_chunk;
  }
  if (budget_bytes <= 0) {
    bad(fn, "budget_bytes must be positive, got " + std::to_string(budget_bytes) + ".");
  }
  if (prompt_tokens < 0) {
    bad(fn, "prompt_tokens must be >= 0, got " + std::to_string(prompt_tokens) + ".");
  }
  int chunk = kMaxPrefillChunk;
  while (chunk > kMinPrefillChunk &&
         sdpa_fallback_bytes(g, chunk, prompt_tokens) > budget_bytes) {
    chunk /= 2;
  }
  return chunk;
}

int64_t kv_bytes_per_token(const Geometry& g, int kv_bits, int group_size) {
  const char* fn = "kv_bytes_per_token";
  validate_geometry(g, fn);
  return mul_sat(layer_token_bytes(g, kv_bits, group_size, fn), g.n_layers);
}

int64_t kv_bytes_for_context(const Geometry& g, int64_t tokens, int kv_bits, int group_size) {
  const char* fn = "kv_bytes_for_context";
  validate_geometry(g, fn);
  if (tokens < 0) {
    bad(fn, "tokens must be >= 0, got " + std::to_string(tokens) + ".");
  }
  const int64_t per_layer = layer_token_bytes(g, kv_bits, group_size, fn);
  int64_t total = 0;
  for (int layer = 0; layer < g.n_layers; ++layer) {
    const int w = window_of(g, layer);
    const int64_t held = w > 0 ? std::min<int64_t>(tokens, w) : tokens;
    total = add_sat(total, mul_sat(per_layer, held));
  }
  return total;
}

std::optional<int64_t> max_context_for_budget(
    const Geometry& g, int64_t budget_bytes, int kv_bits, int group_size) {
  const char* fn = "max_context_for_budget";
  validate_geometry(g, fn);
  if (budget_bytes < 0) {
    bad(fn, "budget_bytes must be >= 0, got " + std::to_string(budget_bytes) + ".");
  }
  const int64_t per_layer = layer_token_bytes(g, kv_bits, group_size, fn);
  bool any_global = false;
  int64_t max_window = 0;
  for (int layer = 0; layer < g.n_layers; ++layer) {
    const int w = window_of(g, layer);
    any_global = any_global || w == 0;
    max_window = std::max<int64_t>(max_window, w);
  }
  auto fits = [&](int64_t t) {
    return kv_bytes_for_context(g, t, kv_bits, group_size) <= budget_bytes;
  };
  if (!any_global && fits(max_window)) {
    return std::nullopt;
  }
  // KV bytes grow monotonically with context; every token costs at least
  // one layer's bytes until the last window fills, hence this upper bound.
  int64_t lo = 0;
  int64_t hi = add_sat(budget_bytes / per_layer, max_window) + 1;  // does not fit
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace mlx_infer
