// paged_attention: the op, its CPU primitive and the gather reference (see
// mlx_infer/paged_attention.h; the CUDA kernels are in paged_attention_cuda.cpp).
#include "mlx_infer/paged_attention.h"
#include "mlx_infer/text.h"

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "mlx_infer/backend.h"

#include "../cpu_kernels/array_util.h"
#include "../cpu_kernels/elem.h"
#include "../cpu_kernels/threadpool.h"
#include "mlx_infer/softcap_attention.h"
#include "paged_attention_cuda.h"

namespace mlx_infer {

namespace {

using namespace detail;

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[paged_attention] " + what);
}

std::string shape_str(const mx::array& a) {
  return shape_text(a.shape());
}

void validate(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& tables,
              const mx::array& lengths, float softcap, const std::optional<mx::array>& sinks) {
  if (!(softcap >= 0.0f) || std::isinf(softcap)) fail("softcap must be a finite number >= 0 (0 = no cap).");
  if (sinks && (sinks->ndim() != 1 || q.ndim() != 3 || sinks->shape(0) != q.shape(1) ||
                !mx::issubdtype(sinks->dtype(), mx::floating))) {
    fail("sinks must be (H,) floating point, one logit per query head, got " + shape_str(*sinks) + ".");
  }
  if (q.ndim() != 3) fail("q must be (R, H, D), got " + shape_str(q) + ".");
  if (k.ndim() != 4 || k.shape() != v.shape()) {
    fail("k_storage and v_storage must share one (pages, KVH, P, D) shape, got " + shape_str(k) + " and " +
         shape_str(v) + ".");
  }
  const int R = q.shape(0), H = q.shape(1), D = q.shape(2), KVH = k.shape(1);
  if (k.shape(3) != D) fail("q's head_dim " + std::to_string(D) + " differs from the storage's " + shape_str(k) + ".");
  if (KVH < 1 || H % KVH != 0) {
    fail("q's " + std::to_string(H) + " heads are not a multiple of the storage's " + std::to_string(KVH) +
         " KV heads.");
  }
  if (tables.ndim() != 2 || tables.shape(0) != R || tables.dtype() != mx::int32) {
    fail("block_tables must be (R, T) int32 with R = " + std::to_string(R) + ", got " + shape_str(tables) + ".");
  }
  if (lengths.ndim() != 1 || lengths.shape(0) != R || lengths.dtype() != mx::int32) {
    fail("lengths must be (R,) int32 with R = " + std::to_string(R) + ", got " + shape_str(lengths) + ".");
  }
  if (!mx::issubdtype(q.dtype(), mx::floating) || !mx::issubdtype(k.dtype(), mx::floating) ||
      k.dtype() != v.dtype()) {
    fail("q and the storage must be floating point (storage K and V of one dtype).");
  }
}

// ---------------------------------------------------------------------------
// CPU: one task per (row, KV head); the task's G = H / KVH query heads share each key it reads.

template <typename T>
inline float ld(const void* p, int64_t i) {
  return cpu::to_f32(static_cast<const T*>(p)[i]);
}

// One call's pointers and sizes (q, storage, tables and lengths contiguous; sinks float32 or null).
struct Problem {
  const void *q, *k, *v;
  const int32_t *tables, *lengths;
  const float* sinks;  // (H,) per-head sink logits, or nullptr
  float* out;          // (R, H, D) float32
  int R, H, KVH, D, P, T;
  int64_t pages;
  int window;
  float scale, softcap;
};

template <typename QT, typename KT>
void attend_task(int64_t task, const Problem& pb) {
  const int H = pb.H, KVH = pb.KVH, D = pb.D, P = pb.P, T = pb.T;
  const int r = static_cast<int>(task / KVH), kvh = static_cast<int>(task % KVH);
  const int G = H / KVH;
  const int len = pb.lengths[r];
  const int lo = pb.window > 0 ? std::max(0, len - pb.window) : 0;
  const int hi = std::min(len, T * P);  // a table never covers more than T pages
  std::vector<float> qf(static_cast<size_t>(G) * D), acc(static_cast<size_t>(G) * D, 0.0f);
  std::vector<float> m(G, -std::numeric_limits<float>::infinity()), l(G, 0.0f), s(G);
  for (int g = 0; g < G; ++g) {
    const int64_t base = (static_cast<int64_t>(r) * H + kvh * G + g) * D;
    for (int d = 0; d < D; ++d) qf[g * D + d] = ld<QT>(pb.q, base + d) * pb.scale;
    if (pb.sinks != nullptr) {  // the sink joins the softmax as one more score, with no value: exp(0) = 1 at m
      m[g] = pb.sinks[kvh * G + g];
      l[g] = 1.0f;
    }
  }
  std::vector<float> kf(D), vf(D);
  for (int j = lo; j < hi; ++j) {
    int64_t page = pb.tables[static_cast<int64_t>(r) * T + j / P];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), pb.pages - 1);  // memory safety only: a caller contract
    const int64_t at = ((page * KVH + kvh) * P + j % P) * D;
    for (int d = 0; d < D; ++d) {
      kf[d] = ld<KT>(pb.k, at + d);
      vf[d] = ld<KT>(pb.v, at + d);
    }
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
      const float* qg = &qf[g * D];
      for (int d = 0; d < D; ++d) dot += qg[d] * kf[d];
      s[g] = pb.softcap > 0.0f ? pb.softcap * std::tanh(dot / pb.softcap) : dot;
    }
    for (int g = 0; g < G; ++g) {
      float* a = &acc[g * D];
      if (s[g] > m[g]) {
        const float c = std::exp(m[g] - s[g]);  // exp(-inf) = 0 on the first key
        l[g] *= c;
        for (int d = 0; d < D; ++d) a[d] *= c;
        m[g] = s[g];
      }
      const float p = std::exp(s[g] - m[g]);
      l[g] += p;
      for (int d = 0; d < D; ++d) a[d] += p * vf[d];
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    float* o = pb.out + (static_cast<int64_t>(r) * H + kvh * G + g) * D;
    for (int d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
  }
}

template <typename QT, typename KT>
void attend_all(const Problem& pb) {
  cpu::pool().parallel_for(static_cast<int64_t>(pb.R) * pb.KVH, [&](int64_t task) { attend_task<QT, KT>(task, pb); });
}

template <typename QT>
void dispatch_kv(mx::Dtype kt, const Problem& pb) {
  if (kt == mx::float32) {
    attend_all<QT, float>(pb);
  } else if (kt == mx::bfloat16) {
    attend_all<QT, cpu::bf16_t>(pb);
  } else {
    attend_all<QT, cpu::f16_t>(pb);
  }
}

void store_out(const float* src, void* dst, mx::Dtype t, size_t n) {
  if (t == mx::float32) {
    std::copy(src, src + n, static_cast<float*>(dst));
  } else if (t == mx::bfloat16) {
    auto* o = static_cast<cpu::bf16_t*>(dst);
    for (size_t i = 0; i < n; ++i) o[i] = cpu::to_bf16(src[i]);
  } else {
    auto* o = static_cast<cpu::f16_t*>(dst);
    for (size_t i = 0; i < n; ++i) o[i] = cpu::to_f16(src[i]);
  }
}

class PagedAttentionCPU : public mx::UnaryPrimitive {
 public:
  PagedAttentionCPU(mx::Stream s, int window, float scale, float softcap)
      : mx::UnaryPrimitive(s), window_(window), scale_(scale), softcap_(softcap) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out_ptr = out.data<void>(), out_dtype = out.dtype(), out_size = out.size(),
                  window = window_, scale = scale_, softcap = softcap_]() {
      const auto &q = inputs[0], &k = inputs[1], &v = inputs[2], &tables = inputs[3], &lengths = inputs[4];
      std::vector<uint8_t> qb, kb, vb, tb, lb, sb;
      Problem pb{};
      pb.q = contiguous_bytes(q, qb);
      pb.k = contiguous_bytes(k, kb);  // the storage is row-contiguous: no copy
      pb.v = contiguous_bytes(v, vb);
      pb.tables = static_cast<const int32_t*>(contiguous_bytes(tables, tb));
      pb.lengths = static_cast<const int32_t*>(contiguous_bytes(lengths, lb));
      pb.sinks = inputs.size() > 5 ? static_cast<const float*>(contiguous_bytes(inputs[5], sb)) : nullptr;
      pb.R = q.shape(0), pb.H = q.shape(1), pb.D = q.shape(2), pb.KVH = k.shape(1), pb.P = k.shape(2);
      pb.T = tables.shape(1);
      pb.pages = k.shape(0);
      pb.window = window, pb.scale = scale, pb.softcap = softcap;
      std::vector<float> acc(out_size);
      pb.out = acc.data();
      if (q.dtype() == mx::float32) {
        dispatch_kv<float>(k.dtype(), pb);
      } else if (q.dtype() == mx::bfloat16) {
        dispatch_kv<cpu::bf16_t>(k.dtype(), pb);
      } else {
        dispatch_kv<cpu::f16_t>(k.dtype(), pb);
      }
      store_out(acc.data(), out_ptr, out_dtype, out_size);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override { gpu_unreachable(name()); }

  const char* name() const override { return "PagedAttentionCPU"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedAttentionCPU&>(other);
    return window_ == o.window_ && scale_ == o.scale_ && softcap_ == o.softcap_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int window_;
  float scale_;
  float softcap_;  // 0: no cap
};

}  // namespace

std::pair<mx::array, mx::array> paged_gather_index(const mx::array& block_tables, const mx::array& lengths,
                                                   int window, int kv_heads, int page_size) {
  const int R = block_tables.shape(0), T = block_tables.shape(1);
  const int S = window > 0 ? std::min(T * page_size, window) : T * page_size;
  auto len = mx::reshape(lengths, {R, 1});                                            // (R, 1)
  auto lo = window > 0 ? mx::maximum(mx::subtract(len, mx::array(window, mx::int32)), mx::array(0, mx::int32))
                       : mx::zeros({R, 1}, mx::int32);                                  // (R, 1)
  auto pos = mx::add(lo, mx::reshape(mx::arange(0, S, 1, mx::int32), {1, S}));         // (R, S)
  auto valid = mx::less(pos, len);                                                     // (R, S)
  auto zero = mx::array(0, mx::int32);
  pos = mx::where(valid, pos, zero);
  auto P = mx::array(page_size, mx::int32);
  auto logical = mx::minimum(mx::floor_divide(pos, P), mx::array(T - 1, mx::int32));  // (R, S)
  auto pages = mx::where(valid, mx::take_along_axis(block_tables, logical, 1), zero);   // (R, S)
  auto offsets = mx::where(valid, mx::remainder(pos, P), zero);                         // (R, S)
  auto h = mx::reshape(mx::arange(0, kv_heads, 1, mx::int32), {1, kv_heads, 1});
  // ((page * KVH + head) * P + offset) in the (pages * KVH * P, D) view
  auto rows = mx::add(mx::multiply(mx::add(mx::multiply(mx::reshape(pages, {R, 1, S}),
                                                        mx::array(kv_heads, mx::int32)), h), P),
                      mx::reshape(offsets, {R, 1, S}));  // (R, KVH, S)
  return {rows, mx::reshape(valid, {R, 1, 1, S})};
}

mx::array paged_attention_gather(const mx::array& q, const mx::array& k_storage, const mx::array& v_storage,
                                 const mx::array& block_tables, const mx::array& lengths, int window,
                                 float scale, float softcap, const std::optional<mx::array>& sinks,
                                 mx::StreamOrDevice s) {
  validate(q, k_storage, v_storage, block_tables, lengths, softcap, sinks);
  const int R = q.shape(0), H = q.shape(1), D = q.shape(2);
  auto [rows, mask] = paged_gather_index(block_tables, lengths, window, k_storage.shape(1), k_storage.shape(2));
  auto keys = mx::take(mx::reshape(k_storage, {-1, D}, s), rows, 0, s);    // (R, KVH, S, D)
  auto values = mx::take(mx::reshape(v_storage, {-1, D}, s), rows, 0, s);  // (R, KVH, S, D)
  auto q4 = mx::reshape(q, {R, H, 1, D}, s);
  if (keys.dtype() != q.dtype()) {
    keys = mx::astype(keys, q.dtype(), s);
    values = mx::astype(values, q.dtype(), s);
  }
  auto out = softcap > 0.0f
      ? softcapped_attention(q4, keys, values, scale, softcap, mask, sinks, s)
      : mx::fast::scaled_dot_product_attention(q4, keys, values, scale, "array", mask, sinks, false, s);
  return mx::reshape(out, {R, H, D}, s);  // (R, H, D)
}

std::string paged_attention_backend(const mx::array& q, const mx::array& k_storage, mx::StreamOrDevice s) {
  if (q.ndim() != 3 || k_storage.ndim() != 4) {
    fail("paged_attention_backend takes q (R, H, D) and a storage (pages, KVH, P, D), got " + shape_str(q) +
         " and " + shape_str(k_storage) + ".");
  }
  return paged_attention_backend(q.shape(1), q.shape(2), q.dtype(), k_storage, s);
}

std::string paged_attention_backend(int heads, int head_dim, mx::Dtype q_dtype, const mx::array& k_storage,
                                    mx::StreamOrDevice s) {
  if (k_storage.ndim() != 4 || heads <= 0 || head_dim <= 0 || heads % k_storage.shape(1) != 0) {
    fail("paged_attention_backend takes " + std::to_string(heads) + " heads of " + std::to_string(head_dim) +
         " features over a storage (pages, KVH, P, D) whose KVH divides them, got " + shape_str(k_storage) + ".");
  }
  const auto stream = mx::to_stream(s);
  if (on_cpu(stream)) {
    return kernel_dtype(q_dtype) && kernel_dtype(k_storage.dtype()) ? "cpu" : "gather";
  }
  // Metal: no paged kernel yet (none could be run and tested on this project's machines).
  if (cuda_backend() && cuda_paged_attention_supports(heads, head_dim, q_dtype, k_storage)) {
    return "cuda";
  }
  return "gather";
}

mx::array paged_attention(const mx::array& q, const mx::array& k_storage, const mx::array& v_storage,
                          const mx::array& block_tables, const mx::array& lengths, int window, float scale,
                          float softcap, const std::optional<mx::array>& sinks, mx::StreamOrDevice s,
                          bool flat_heads, const std::optional<mx::array>& split_counts) {
  validate(q, k_storage, v_storage, block_tables, lengths, softcap, sinks);
  const auto backend = paged_attention_backend(q, k_storage, s);
  const int R = q.shape(0), HD = q.shape(1) * q.shape(2);
  auto shaped = [&](mx::array out) { return flat_heads ? mx::reshape(out, {R, HD}, s) : out; };
  if (backend == "gather") {
    return shaped(
        paged_attention_gather(q, k_storage, v_storage, block_tables, lengths, window, scale, softcap, sinks, s));
  }
  // The kernels read the sinks as float32 (exact from any float dtype).
  std::optional<mx::array> sinks32;
  if (sinks) sinks32 = mx::astype(*sinks, mx::float32, s);
  if (backend == "cuda") {
    return cuda_paged_attention(q, k_storage, v_storage, block_tables, lengths, window, scale, softcap, sinks32,
                                mx::to_stream(s), flat_heads, split_counts);
  }
  std::vector<mx::array> inputs{q, k_storage, v_storage, block_tables, lengths};
  if (sinks32) inputs.push_back(*sinks32);
  return shaped(mx::array(q.shape(), q.dtype(),
                          std::make_shared<PagedAttentionCPU>(mx::to_stream(s), window, scale, softcap),
                          std::move(inputs)));
}

}  // namespace mlx_infer
