// Which MLX backend the process runs on, the limits of its kernels the C++ graphs work around, and how our
// custom CUDA kernels are launched.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <mlx/fast.h>
#include <mlx/mlx.h>

namespace mlx_infer {

namespace mx = mlx::core;

/// True where MLX's CUDA backend is available (a Linux wheel with an NVIDIA GPU).
bool cuda_backend();

/// Rows per ``mx::fast::rope`` call so MLX's CUDA kernel launches: MLX 0.32's general RoPE kernel
/// (per-row offsets, ``mlx/backend/cuda/rope.cu``) sizes its block over (dims / 2, T, B * ceil(N / 4))
/// with up to 1024 threads and no cap on the z extent, so with ``dims < 32`` and 128 or more
/// (row, 4 heads) groups the block's z extent exceeds CUDA's 64 and the launch is refused
/// ("cudaLaunchKernelExC / cudaGraphAddKernelNode ... invalid argument"). Returns ``B`` where one call
/// is fine (and on every other backend: ``cuda`` false), else the most rows a call can take.
int rope_rows_per_call(int B, int heads, int T, int dims, bool cuda = cuda_backend());

/// An integer environment knob in [lo, hi], ``fallback`` where unset or empty; anything else throws
/// std::invalid_argument naming the variable, its range, ``meaning`` (what a value means, if anything) and the
/// default. Read at each call, so a process can compare both settings.
long env_int(const char* name, long lo, long hi, long fallback, const char* meaning = "");

/// The float dtypes our custom CUDA kernels are written for: float32, bfloat16, float16.
inline bool cuda_float_dtype(mx::Dtype t) {
  return t == mx::float32 || t == mx::bfloat16 || t == mx::float16;
}

/// An ``mx::fast::cuda_kernel`` function (same call) whose ``CustomKernel`` primitive is made once per launch
/// signature and reused by every later call with it. MLX's function rebuilds the kernel's whole source text at
/// each call (~3 us of host time a launch: benchmarks/submit_cost.py, benchmarks/RESULTS.md "Session 21"), and a
/// decode step launches the same ~30-100 kernels with the same template arguments, dtypes and grid every step.
/// The signature is everything the primitive holds: the template arguments, the inputs' dtypes and whether each
/// has dimensions, the outputs' dtypes, the grid, the threadgroup, the initial value and the stream; the output
/// shapes and the inputs are the new node's own. A primitive is immutable (its evaluation reads the inputs it is
/// handed), and mx::compile's replays reuse theirs the same way. ``MLX_INFER_REUSE_KERNELS=0`` (read at each
/// call) calls MLX's function every time; so does ``verbose``, and so does a new signature once 512 are kept
/// (a prompt chunk's grid follows its row count). Copies share the cache.
class ReusedKernel {
 public:
  using Grid = std::tuple<int, int, int>;
  using TemplateArgs = std::vector<std::pair<std::string, mx::fast::TemplateArg>>;

  ReusedKernel() = default;
  explicit ReusedKernel(mx::fast::CustomKernelFunction fn);

  std::vector<mx::array> operator()(const std::vector<mx::array>& inputs, const std::vector<mx::Shape>& output_shapes,
                                    const std::vector<mx::Dtype>& output_dtypes, Grid grid, Grid threadgroup,
                                    const TemplateArgs& template_args, std::optional<float> init_value, bool verbose,
                                    mx::StreamOrDevice s) const;

  /// Primitives made so far (distinct signatures): for tests.
  int signatures() const;

 private:
  struct Cache;
  mx::fast::CustomKernelFunction fn_;
  std::shared_ptr<Cache> cache_;
};

/// Whether ReusedKernel reuses primitives (``MLX_INFER_REUSE_KERNELS`` unset or anything but ``0``).
bool reuse_kernels_enabled();

}  // namespace mlx_infer
