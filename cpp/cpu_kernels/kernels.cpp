// Run-time choice of the kernel variant: the widest instruction set the CPU has
// (checked once with __builtin_cpu_supports), unless tests force a narrower one.
#include "kernels.h"

#include <atomic>

namespace mlx_infer::cpu {

namespace {

Isa detect() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma")) {
    return __builtin_cpu_supports("avx512vnni") ? Isa::avx512vnni : Isa::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Isa::avx2;  // every AVX2 CPU also has F16C
  }
#endif
  return Isa::generic;
}

std::atomic<int> forced{-1};

}  // namespace

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

Isa default_isa() {
  // avx512vnni rounds x to int8 in quantized GEMV (~6% faster decode of a 4-bit
  // Gemma 3 270M here): opt-in, so the default kernels keep float32 inputs exact.
  const Isa d = detected_isa();
  return d == Isa::avx512vnni ? Isa::avx512 : d;
}

Isa active_isa() {
  const int f = forced.load(std::memory_order_relaxed);
  return f < 0 ? default_isa() : static_cast<Isa>(f);
}

void force_isa(Isa isa) { forced.store(static_cast<int>(isa)); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512vnni: return "avx512vnni";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

void dense_matmul(const DenseProblem& p) {
  switch (active_isa()) {
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::avx512vnni:
    case Isa::avx512: avx512::dense_matmul(p); return;
    case Isa::avx2: avx2::dense_matmul(p); return;
#endif
    default: generic::dense_matmul(p); return;
  }
}

void quant_matmul(const QuantProblem& p) {
  switch (active_isa()) {
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::avx512vnni:
      if (avx512vnni::quant_gemv(p)) {
        return;
      }
      avx512::quant_matmul(p);
      return;
    case Isa::avx512: avx512::quant_matmul(p); return;
    case Isa::avx2: avx2::quant_matmul(p); return;
#endif
    default: generic::quant_matmul(p); return;
  }
}

void attention(const AttnProblem& p) {
  switch (active_isa()) {
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::avx512vnni:
    case Isa::avx512: avx512::attention(p); return;
    case Isa::avx2: avx2::attention(p); return;
#endif
    default: generic::attention(p); return;
  }
}

void gated_activation(const GatedActProblem& p) {
  switch (active_isa()) {
#if defined(__x86_64__) || defined(_M_X64)
    case Isa::avx512vnni:
    case Isa::avx512: avx512::gated_activation(p); return;
    case Isa::avx2: avx2::gated_activation(p); return;
#endif
    default: generic::gated_activation(p); return;
  }
}

}  // namespace mlx_infer::cpu
