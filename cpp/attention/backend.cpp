// mlx_infer/backend.h: the backend query and the kernel limits the graphs work around.
#include "mlx_infer/backend.h"

#if __has_include(<mlx/backend/cuda/cuda.h>)  // every Linux wheel; maybe not a macOS one
#include <mlx/backend/cuda/cuda.h>
#define MLXI_HAS_CUDA_HEADER 1
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace mlx_infer {

bool cuda_backend() {
#ifdef MLXI_HAS_CUDA_HEADER
  static const bool yes = mlx::core::cu::is_available();
  return yes;
#else
  return false;
#endif
}

namespace {

// MLX's get_block_dims_common (mlx/backend/common/utils.cpp): powers of two over the three
// extents, one at a time in turn, up to 2^10 threads; the z extent it gives.
int mlx_block_z(int dim0, int dim1, int dim2) {
  int pows[3] = {0, 0, 0};
  int sum = 0;
  while (true) {
    const int presum = sum;
    if (dim0 >= (1 << (pows[0] + 1))) {
      ++pows[0];
      ++sum;
    }
    if (sum == 10) break;
    if (dim1 >= (1 << (pows[1] + 1))) {
      ++pows[1];
      ++sum;
    }
    if (sum == 10) break;
    if (dim2 >= (1 << (pows[2] + 1))) {
      ++pows[2];
      ++sum;
    }
    if (sum == presum || sum == 10) break;
  }
  return 1 << pows[2];
}

}  // namespace

int rope_rows_per_call(int B, int heads, int T, int dims, bool cuda) {
  constexpr int kMaxBlockZ = 64;  // CUDA's limit on blockDim.z
  if (!cuda || B <= 1) {
    return B;
  }
  const int groups = (heads + 3) / 4;  // the kernel's 4 heads per thread
  if (mlx_block_z(dims / 2, T, B * groups) <= kMaxBlockZ) {
    return B;
  }
  // z extents below 2 * kMaxBlockZ give a block z of at most kMaxBlockZ.
  return std::max(1, (2 * kMaxBlockZ - 1) / groups);
}

// Primitives one ReusedKernel keeps at most (each holds its kernel's source, ~2-10 KB): a decode step's
// signatures come first and stay; a prompt chunk's grid follows its row count, so a long-running server would
// otherwise keep one per count it has seen. Past the cap a new signature calls MLX's function, as before.
constexpr std::size_t kMaxSignatures = 512;

struct ReusedKernel::Cache {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<mx::Primitive>> made;
};

ReusedKernel::ReusedKernel(mx::fast::CustomKernelFunction fn)
    : fn_(std::move(fn)), cache_(std::make_shared<Cache>()) {}

long env_int(const char* name, long lo, long hi, long fallback, const char* meaning) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    return fallback;
  }
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi) {
    throw std::invalid_argument(std::string(name) + "='" + v + "' is not an integer in [" + std::to_string(lo) +
                                ", " + std::to_string(hi) + "]" + (*meaning ? std::string(" (") + meaning + ")" : "") +
                                "; unset it for the default " + std::to_string(fallback) + ".");
  }
  return x;
}

bool reuse_kernels_enabled() {
  const char* v = std::getenv("MLX_INFER_REUSE_KERNELS");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

namespace {

void put(std::string& key, int v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof v);
}

}  // namespace

std::vector<mx::array> ReusedKernel::operator()(const std::vector<mx::array>& inputs,
                                                const std::vector<mx::Shape>& output_shapes,
                                                const std::vector<mx::Dtype>& output_dtypes, Grid grid,
                                                Grid threadgroup, const TemplateArgs& template_args,
                                                std::optional<float> init_value, bool verbose,
                                                mx::StreamOrDevice s) const {
  if (verbose || !cache_ || !reuse_kernels_enabled()) {
    return fn_(inputs, output_shapes, output_dtypes, grid, threadgroup, template_args, init_value, verbose, s);
  }
  const mx::Stream stream = mx::to_stream(s);
  std::string key;
  key.reserve(96 + 16 * template_args.size());
  for (int v : {std::get<0>(grid), std::get<1>(grid), std::get<2>(grid), std::get<0>(threadgroup),
                std::get<1>(threadgroup), std::get<2>(threadgroup), stream.index,
                static_cast<int>(stream.device.type), stream.device.index, static_cast<int>(inputs.size()),
                static_cast<int>(output_dtypes.size())}) {
    put(key, v);
  }
  for (const auto& a : inputs) {
    put(key, static_cast<int>(a.dtype().val()) * 2 + (a.ndim() > 0 ? 1 : 0));
  }
  for (const auto& d : output_dtypes) {
    put(key, static_cast<int>(d.val()));
  }
  if (init_value) {
    float f = *init_value;
    key.push_back('i');
    key.append(reinterpret_cast<const char*>(&f), sizeof f);
  }
  for (const auto& [name, arg] : template_args) {
    key += name;
    key.push_back('=');
    if (const int* i = std::get_if<int>(&arg)) {
      put(key, *i);
    } else if (const bool* b = std::get_if<bool>(&arg)) {
      key.push_back(*b ? 't' : 'f');
    } else {
      put(key, static_cast<int>(std::get<mx::Dtype>(arg).val()));
    }
    key.push_back(';');
  }
  {
    std::lock_guard<std::mutex> lock(cache_->mu);
    auto it = cache_->made.find(key);
    if (it != cache_->made.end()) {
      return mx::array::make_arrays(output_shapes, output_dtypes, it->second, inputs);
    }
  }
  auto outs = fn_(inputs, output_shapes, output_dtypes, grid, threadgroup, template_args, init_value, verbose, s);
  if (!outs.empty() && outs[0].has_primitive()) {
    std::lock_guard<std::mutex> lock(cache_->mu);
    if (cache_->made.size() < kMaxSignatures) {
      cache_->made.emplace(std::move(key), outs[0].primitive_ptr());
    }
  }
  return outs;
}

int ReusedKernel::signatures() const {
  if (!cache_) {
    return 0;
  }
  std::lock_guard<std::mutex> lock(cache_->mu);
  return static_cast<int>(cache_->made.size());
}

}  // namespace mlx_infer
