// tuned_linear (mlx_infer/matmul.h): `x @ w.T` on CUDA through cuBLASLt with the fastest algorithm per shape.
//
// MLX's CUDA matmul (mlx/backend/cuda/cublas_utils.cpp, CublasMatmulBase::execute_matmul) runs cuBLASLt's
// first heuristic. At the decode-sized M (8..256 rows) with N, K of a linear layer that first pick often
// launches too few blocks to fill the GPU (measured on an H200, benchmarks/products.py: llama-8B q at M = 8,
// 42 us vs 23 us for torch's cuBLAS). TunedProduct asks the heuristic for up to 16 candidates, adds split-K
// variants of them, times each once per (M, N, K, dtype, alignment, bias) on a private stream (the L2 flushed
// before each run, as decode streams its weights) and keeps the fastest among those whose captured launch keeps
// MLX's CUDA graph updatable. A bias (N,) goes in cuBLASLt's epilogue, as MLX's addmm does.
//
// Memory: MLX 0.32's exported allocator::malloc hands out unified (managed) memory, and a cached device buffer
// it hands back is first copied to unified memory (a blocking cudaMemcpy per call); its stream-ordered
// cu::malloc_async is not exported from libmlx. The outputs and workspaces therefore come from a small pool of
// device buffers of our own (cudaMallocAsync on MLX's default memory pool, never freed, recycled when MLX
// drops the array), wrapped as MLX buffers (a cu::CudaBuffer each, the layout MLX's kernels and graph
// dependency tracking read) with a deleter that returns them to the pool.
//
// Without MLXI_CUBLAS (no CUDA toolkit or MLX CUDA headers at build time) tuned_linear is mx::matmul.
#include "mlx_infer/backend.h"
#include "mlx_infer/text.h"
#include "mlx_infer/matmul.h"

#include <mlx/primitives.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef MLXI_CUBLAS
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <mlx/backend/cuda/device.h>
#include <mlx/backend/cuda/utils.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#endif

namespace mlx_infer {

namespace {

bool tuned_dtype(mx::Dtype t) { return t == mx::bfloat16 || t == mx::float16; }

void check_linear_args(const mx::array& x, const mx::array& w) {
  if (x.ndim() < 1 || w.ndim() != 2 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("[tuned_linear] x must be (..., K) and w (N, K) with the same K; got x of shape " +
                                shape_text(x.shape()) + " and w of shape " + shape_text(w.shape()) +
                                ". Pass the layer's weight as stored by nn.Linear (out_features, in_features).");
  }
}

#ifdef MLXI_CUBLAS

namespace cu = mlx::core::cu;

constexpr size_t kMaxWorkspace = 32u << 20;  // cuBLAS's recommendation for Hopper and later
constexpr int kHeuristics = 16;
constexpr int kSplitBases = 4;
constexpr int kWarmup = 2;
constexpr int kTimed = 10;

void check_cuda(const char* what, cudaError_t err) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("[TunedProduct] ") + what + " failed: " + cudaGetErrorString(err));
  }
}

void check_cublas(const char* what, cublasStatus_t st) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("[TunedProduct] ") + what + " failed: " + cublasLtGetStatusString(st));
  }
}

// MLX_INFER_TUNED_PRODUCTS_LOG: 1 logs each shape's choice; 2 also every stage of the first calls (where a
// crash happens, on a machine without a debugger: see _fast.install_crash_backtrace).
int log_level() {
  static const int level = [] {
    const char* v = std::getenv("MLX_INFER_TUNED_PRODUCTS_LOG");
    return v == nullptr || std::strcmp(v, "") == 0 ? 0 : std::atoi(v) > 0 ? std::atoi(v) : 0;
  }();
  return level;
}

bool log_choices() { return log_level() >= 1; }

void trace(const char* stage) {
  if (log_level() >= 2) {
    std::fprintf(stderr, "[mlx_infer tuned_linear] %s\n", stage);
    std::fflush(stderr);
  }
}

// Our CUDA runtime (linked statically, apart from libmlx's own static one) on the device MLX evaluates on: its
// current device is its own per-thread state, which MLX's cudaSetDevice does not set.
void use_device(int device) {
  thread_local int current = -1;
  if (current != device) {
    check_cuda("cudaSetDevice", cudaSetDevice(device));
    current = device;
  }
}

// One cuBLASLt handle per (thread, device), as MLX keeps its own; never destroyed (process lifetime: a
// destructor at thread or process exit could run after the CUDA runtime is gone).
cublasLtHandle_t lt_handle(int device) {
  thread_local std::unordered_map<int, cublasLtHandle_t> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  check_cublas("cublasLtCreate", cublasLtCreate(&h));
  handles.emplace(device, h);
  return h;
}

// A private non-blocking stream per device: pool allocations and the timing runs (never captured by MLX).
cudaStream_t private_stream(int device) {
  static std::mutex mu;
  static auto* streams = new std::unordered_map<int, cudaStream_t>;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams->find(device);
  if (it != streams->end()) return it->second;
  cudaStream_t s = nullptr;
  check_cuda("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  streams->emplace(device, s);
  return s;
}

// ---- device buffers (see the file comment) ----

// Free buffers by (device, bytes). A request takes the smallest free buffer of at least its size and less than
// twice it (as MLX's buffer cache reuses), so the rows of a batch growing or shrinking reuse what is there.
struct BufferPool {
  std::mutex mu;
  std::multimap<std::pair<int, size_t>, cu::CudaBuffer*> free;
};

BufferPool& pool() {
  static auto* p = new BufferPool;  // leaked: deleters may run during process teardown
  return *p;
}

void recycle(mx::allocator::Buffer b) {
  auto* buf = static_cast<cu::CudaBuffer*>(b.ptr());
  if (buf == nullptr) return;
  if (buf->device < 0) {
    // MLX moved it to unified memory (a CPU read: Buffer::raw_ptr) and freed our device memory itself; the
    // unified memory is managed (cudaMallocManaged) or, without managed memory, pinned host memory.
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, buf->data) == cudaSuccess && attr.type == cudaMemoryTypeHost) {
      cudaFreeHost(buf->data);
    } else {
      cudaFree(buf->data);
    }
    cudaGetLastError();
    delete buf;
    return;
  }
  auto& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  p.free.emplace(std::make_pair(buf->device, buf->size), buf);
}

mx::allocator::Data device_buffer(size_t bytes, int device) {
  bytes = std::max<size_t>(256, (bytes + 255) / 256 * 256);
  auto& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mu);
    auto it = p.free.lower_bound({device, bytes});
    if (it != p.free.end() && it->first.first == device && it->first.second < 2 * bytes) {
      auto* buf = it->second;
      p.free.erase(it);
      return mx::allocator::Data(mx::allocator::Buffer(buf), recycle);
    }
  }
  void* data = nullptr;
  cudaStream_t s = private_stream(device);
  check_cuda("cudaMallocAsync", cudaMallocAsync(&data, bytes, s));
  check_cuda("cudaStreamSynchronize", cudaStreamSynchronize(s));  // usable from every stream from here on
  auto* buf = new cu::CudaBuffer{data, bytes, device};
  return mx::allocator::Data(mx::allocator::Buffer(buf), recycle);
}

// ---- plans: descriptors and the chosen algorithm per key ----

struct Key {
  int device, M, N, K;
  cudaDataType_t type;
  int align_x, align_w;
  bool bias;  // + bias (N,) in cuBLASLt's epilogue, as MLX's addmm
  bool operator<(const Key& o) const {
    return std::tie(device, M, N, K, type, align_x, align_w, bias) <
           std::tie(o.device, o.M, o.N, o.K, o.type, o.align_x, o.align_w, o.bias);
  }
};

// The operation: out^T = w x^T in float32 accumulation (see plan_for's layouts), + bias when given.
cublasLtMatmulDesc_t make_desc(const void* bias) {
  cublasLtMatmulDesc_t desc = nullptr;
  check_cublas("cublasLtMatmulDescCreate", cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  check_cublas("cublasLtMatmulDescSetAttribute",
               cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  check_cublas("cublasLtMatmulDescSetAttribute",
               cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (bias != nullptr) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;  // bias of the output's type, one per output feature
    check_cublas("cublasLtMatmulDescSetAttribute",
                 cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    check_cublas("cublasLtMatmulDescSetAttribute",
                 cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  return desc;
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;  // for a key with bias: the tuning call's bias pointer (each call makes its own)
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // a = w, b = x (swapped: row-major result)
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};

int alignment(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && (v % a) != 0) a /= 2;
  return a;
}

std::string describe(const cublasLtMatmulAlgo_t& algo) {
  int32_t id = 0, splitk = 1;
  uint32_t tile = 0, red = 0, stages = 0, swizzle = 0;
  size_t n = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &n);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &n);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &n);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red), &n);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &n);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &n);
  // snprintf, not an ostream: the ostream insert crashed here on the H200 image (session 7, SIGSEGV in
  // std::ostream::_M_insert<long> under the choice log).
  char text[160];
  std::snprintf(text, sizeof(text), "algo %d tile %u splitk %d reduction %u stages %u swizzle %u", id, tile, splitk,
                red, stages, swizzle);
  return std::string(text);
}

struct Candidate {
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
};

// The heuristic's candidates, then split-K variants of those that run unsplit (when cuBLASLt accepts them).
std::vector<Candidate> candidates(cublasLtHandle_t h, Plan& p, const Key& k) {
  cublasLtMatmulPreference_t pref = nullptr;
  check_cublas("cublasLtMatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = kMaxWorkspace;
  uint32_t align_a = static_cast<uint32_t>(k.align_w), align_b = static_cast<uint32_t>(k.align_x), align_d = 256;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d));
  cublasLtMatmulHeuristicResult_t res[kHeuristics];
  int n = 0;
  auto st = cublasLtMatmulAlgoGetHeuristic(h, p.desc, p.a, p.b, p.d, p.d, pref, kHeuristics, res, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  check_cublas("cublasLtMatmulAlgoGetHeuristic", st);
  std::vector<Candidate> out;
  auto seen = [&out](const cublasLtMatmulAlgo_t& a) {
    return std::any_of(out.begin(), out.end(),
                       [&a](const Candidate& c) { return std::memcmp(&c.algo, &a, sizeof(a)) == 0; });
  };
  for (int i = 0; i < n; ++i) {
    if (res[i].state == CUBLAS_STATUS_SUCCESS && !seen(res[i].algo)) out.push_back({res[i].algo, res[i].workspaceSize});
  }
  const size_t heuristic = out.size();
  int expanded = 0;  // split-K variants of the first kSplitBases unsplit candidates (bounds the tuning time)
  for (size_t i = 0; i < heuristic && expanded < kSplitBases; ++i) {
    int32_t splitk = 1;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&out[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk),
                                             &written) != CUBLAS_STATUS_SUCCESS ||
        splitk != 1) {
      continue;
    }
    ++expanded;
    for (int32_t splits : {2, 4, 8, 16}) {
      if (splits > 1 && k.K / splits < 256) break;  // slices too thin to pay for their reduction
      for (uint32_t scheme : {static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE),
                              static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE)}) {
        cublasLtMatmulAlgo_t a = out[i].algo;
        if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits)) !=
                CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                 sizeof(scheme)) != CUBLAS_STATUS_SUCCESS) {
          continue;
        }
        cublasLtMatmulHeuristicResult_t check{};
        if (cublasLtMatmulAlgoCheck(h, p.desc, p.a, p.b, p.d, p.d, &a, &check) != CUBLAS_STATUS_SUCCESS ||
            check.workspaceSize > kMaxWorkspace || seen(a)) {
          continue;
        }
        out.push_back({a, check.workspaceSize});
      }
    }
  }
  return out;
}

bool graph_friendly(cublasLtHandle_t h, const Plan& p, const Key& k, const Candidate& c, const void* x,
                    const void* w, void* out, void* ws);

// Median time (us) of each candidate on a private stream, the L2 flushed before each timed run (decode streams
// its weights from HBM); inputs are the real device pointers (their values do not matter for timing).
struct Timings {
  std::vector<float> us;  // per candidate; -1 where it did not run
  int chosen;             // the candidate to keep, or -1 where none ran and captured cleanly
};

Timings time_candidates(cublasLtHandle_t h, const Plan& p, const Key& k, const std::vector<Candidate>& cands,
                        const void* x, const void* w) {
  cudaStream_t s = private_stream(k.device);
  size_t ws_bytes = 0;
  for (const auto& c : cands) ws_bytes = std::max(ws_bytes, c.workspace);
  int l2 = 0;
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, k.device);
  const size_t flush_bytes = std::max<size_t>(2 * static_cast<size_t>(l2), 1u << 20);
  const size_t elem = 2;  // bf16 / f16
  void *out = nullptr, *ws = nullptr, *flush = nullptr;
  check_cuda("cudaMalloc", cudaMalloc(&out, static_cast<size_t>(k.M) * k.N * elem));
  if (ws_bytes) check_cuda("cudaMalloc", cudaMalloc(&ws, ws_bytes));
  check_cuda("cudaMalloc", cudaMalloc(&flush, flush_bytes));
  std::vector<cudaEvent_t> ev(2 * kTimed);
  for (auto& e : ev) check_cuda("cudaEventCreate", cudaEventCreate(&e));
  const float alpha = 1.0f, beta = 0.0f;
  std::vector<float> times(cands.size(), -1.0f);
  for (size_t i = 0; i < cands.size(); ++i) {
    const auto& c = cands[i];
    auto run = [&] {
      return cublasLtMatmul(h, p.desc, &alpha, w, p.a, x, p.b, &beta, out, p.d, out, p.d, &c.algo, ws, c.workspace, s);
    };
    bool ok = true;
    for (int r = 0; r < kWarmup && ok; ++r) ok = run() == CUBLAS_STATUS_SUCCESS;
    for (int r = 0; r < kTimed && ok; ++r) {
      cudaMemsetAsync(flush, r & 0xff, flush_bytes, s);
      cudaEventRecord(ev[2 * r], s);
      ok = run() == CUBLAS_STATUS_SUCCESS;
      cudaEventRecord(ev[2 * r + 1], s);
    }
    if (cudaStreamSynchronize(s) != cudaSuccess) {
      cudaGetLastError();
      ok = false;
    }
    if (!ok) continue;
    std::vector<float> t(kTimed);
    for (int r = 0; r < kTimed; ++r) {
      cudaEventElapsedTime(&t[r], ev[2 * r], ev[2 * r + 1]);
      t[r] *= 1000.0f;
    }
    std::nth_element(t.begin(), t.begin() + kTimed / 2, t.end());
    times[i] = t[kTimed / 2];
  }
  // Fastest first; a candidate within 2% of the fastest with less workspace wins (less memory held per call).
  std::vector<size_t> order;
  for (size_t i = 0; i < cands.size(); ++i) {
    if (times[i] >= 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return times[a] < times[b]; });
  trace("plan: timed; graph capture checks");
  int chosen = -1;
  for (size_t j = 0; j < order.size() && chosen < 0; ++j) {
    if (!graph_friendly(h, p, k, cands[order[j]], x, w, out, ws)) continue;
    chosen = static_cast<int>(order[j]);
    for (size_t r = j + 1; r < order.size() && times[order[r]] <= 1.02f * times[order[j]]; ++r) {
      if (cands[order[r]].workspace < cands[chosen].workspace && graph_friendly(h, p, k, cands[order[r]], x, w, out, ws)) {
        chosen = static_cast<int>(order[r]);
      }
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  cudaFree(flush);
  if (ws) cudaFree(ws);
  cudaFree(out);
  return {times, chosen};
}

// Whether the candidate's launch, captured into a CUDA graph as MLX captures it, keeps MLX's graph updatable:
// kernel and memset nodes only, thread-block clusters along x only (mlx/backend/cuda/device.cpp,
// subgraph_to_key: anything else makes MLX instantiate its graph anew at every commit).
bool graph_friendly(cublasLtHandle_t h, const Plan& p, const Key& k, const Candidate& c, const void* x,
                    const void* w, void* out, void* ws) {
  cudaStream_t s = private_stream(k.device);
  const float alpha = 1.0f, beta = 0.0f;
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const auto st = cublasLtMatmul(h, p.desc, &alpha, w, p.a, x, p.b, &beta, out, p.d, out, p.d, &c.algo, ws,
                                 c.workspace, s);
  cudaGraph_t graph = nullptr;
  const auto end = cudaStreamEndCapture(s, &graph);
  bool ok = st == CUBLAS_STATUS_SUCCESS && end == cudaSuccess && graph != nullptr;
  if (ok) {
    size_t n = 0;
    cudaGraphGetNodes(graph, nullptr, &n);
    std::vector<cudaGraphNode_t> nodes(n);
    if (n) cudaGraphGetNodes(graph, nodes.data(), &n);
    for (auto node : nodes) {
      cudaGraphNodeType type;
      cudaGraphNodeGetType(node, &type);
      if (type == cudaGraphNodeTypeMemset) continue;
      if (type != cudaGraphNodeTypeKernel) {
        ok = false;
        break;
      }
      cudaLaunchAttributeValue v{};
      if (cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributeClusterDimension, &v) == cudaSuccess &&
          (v.clusterDim.y > 1 || v.clusterDim.z > 1)) {
        ok = false;
        break;
      }
    }
  }
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  return ok;
}

const char* type_name(cudaDataType_t t) { return t == CUDA_R_16BF ? "bfloat16" : "float16"; }

// The plan of a key, made and tuned on first use. The mutex also serializes tuning runs.
const Plan& plan_for(const Key& k, cudaStream_t mlx_stream, const void* x, const void* w, const void* bias) {
  static std::mutex mu;
  static auto* plans = new std::map<Key, std::unique_ptr<Plan>>;  // leaked, as MLX leaks its devices
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans->find(k);
  if (it != plans->end()) return *it->second;

  trace("plan: descriptors");
  auto p = std::make_unique<Plan>();
  p->desc = make_desc(bias);
  // Column-major views of the row-major buffers: w (N, K) is K x N (ld K), taken transposed; x (M, K) is
  // K x M (ld K); out (M, N) is N x M (ld N). out^T = w x^T.
  check_cublas("cublasLtMatrixLayoutCreate", cublasLtMatrixLayoutCreate(&p->a, k.type, k.K, k.N, k.K));
  check_cublas("cublasLtMatrixLayoutCreate", cublasLtMatrixLayoutCreate(&p->b, k.type, k.K, k.M, k.K));
  check_cublas("cublasLtMatrixLayoutCreate", cublasLtMatrixLayoutCreate(&p->d, k.type, k.N, k.M, k.N));

  trace("plan: cuBLASLt handle");
  cublasLtHandle_t h = lt_handle(k.device);
  trace("plan: heuristic candidates");
  auto cands = candidates(h, *p, k);
  if (cands.empty()) {
    throw std::runtime_error("[TunedProduct] cuBLASLt has no algorithm for this product (M=" + std::to_string(k.M) +
                             ", N=" + std::to_string(k.N) + ", K=" + std::to_string(k.K) + ").");
  }
  trace("plan: synchronize MLX's stream");
  cudaStreamSynchronize(mlx_stream);  // MLX's committed work done: the timings do not share the GPU with it
  trace("plan: time the candidates");
  const auto t = time_candidates(h, *p, k, cands, x, w);
  // None ran and captured cleanly on the private stream: keep the first heuristic's pick (what MLX runs).
  const size_t best = t.chosen >= 0 ? static_cast<size_t>(t.chosen) : 0;
  p->algo = cands[best].algo;
  p->workspace = cands[best].workspace;
  if (log_choices()) {
    std::fprintf(stderr,
                 "[mlx_infer tuned_linear] M=%d N=%d K=%d %s%s: %zu candidates; chose #%zu %s (workspace %zu B) "
                 "%.1f us; first heuristic %.1f us\n",
                 k.M, k.N, k.K, type_name(k.type), k.bias ? " +bias" : "", cands.size(), best,
                 describe(p->algo).c_str(), p->workspace, t.us[best], t.us[0]);
  }
  return *plans->emplace(k, std::move(p)).first->second;
}

class TunedProduct : public mx::UnaryPrimitive {
 public:
  explicit TunedProduct(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[TunedProduct] is a CUDA-only primitive; tuned_linear builds mx::matmul on the CPU.");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const mx::array* bias = inputs.size() > 2 ? &inputs[2] : nullptr;
    if (!x.flags().row_contiguous || !w.flags().row_contiguous || (bias && !bias->flags().row_contiguous)) {
      throw std::runtime_error("[TunedProduct] inputs must be row-contiguous (tuned_linear makes them so).");
    }
    trace("eval_gpu: command encoder");
    auto& enc = cu::get_command_encoder(stream());
    const int device = enc.device().cuda_device();
    trace("eval_gpu: cudaSetDevice");
    use_device(device);
    Key k{device,
          static_cast<int>(x.size() / w.shape(1)),
          w.shape(0),
          w.shape(1),
          x.dtype() == mx::bfloat16 ? CUDA_R_16BF : CUDA_R_16F,
          alignment(mx::gpu_ptr<void>(x)),
          alignment(mx::gpu_ptr<void>(w)),
          bias != nullptr};
    cudaStream_t cs = enc.stream();
    const void* bias_ptr = bias ? mx::gpu_ptr<void>(*bias) : nullptr;
    trace("eval_gpu: plan");
    const Plan& p = plan_for(k, cs, mx::gpu_ptr<void>(x), mx::gpu_ptr<void>(w), bias_ptr);

    trace("eval_gpu: output buffer");
    out.set_data(device_buffer(out.nbytes(), device));
    trace("eval_gpu: encoder inputs and outputs");
    enc.set_input_array(x);
    enc.set_input_array(w);
    if (bias) enc.set_input_array(*bias);
    enc.set_output_array(out);
    void* ws = nullptr;
    if (p.workspace > 0) {
      mx::array ws_arr(device_buffer(p.workspace, device), {static_cast<int>(p.workspace)}, mx::uint8);
      ws = mx::gpu_ptr<void>(ws_arr);
      enc.add_temporary(ws_arr);  // back to the pool once the graph that uses it has run
    }
    const float alpha = 1.0f, beta = 0.0f;
    auto* o = mx::gpu_ptr<void>(out);
    // This call's bias pointer in a descriptor of its own (the plan's is shared); the launch copies what it reads.
    cublasLtMatmulDesc_t own = bias ? make_desc(bias_ptr) : nullptr;
    cublasStatus_t st;
    trace("eval_gpu: capture and launch");
    {
      auto capture = enc.capture_context();
      st = cublasLtMatmul(lt_handle(device), own ? own : p.desc, &alpha, mx::gpu_ptr<void>(w), p.a,
                          mx::gpu_ptr<void>(x), p.b, &beta, o, p.d, o, p.d, &p.algo, ws, p.workspace, enc.stream());
    }
    if (own) cublasLtMatmulDescDestroy(own);
    trace("eval_gpu: done");
    check_cublas("cublasLtMatmul", st);
  }

  const char* name() const override { return "TunedProduct"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
};

#endif  // MLXI_CUBLAS

}  // namespace

bool tuned_products_available() {
#ifdef MLXI_CUBLAS
  return cuda_backend();
#else
  return false;
#endif
}

mx::array tuned_linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                       mx::StreamOrDevice s) {
  check_linear_args(x, w);
  if (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0))) {
    throw std::invalid_argument("[tuned_linear] bias must be (N,) with N = w.shape(0) = " +
                                std::to_string(w.shape(0)) + ", got " + std::to_string(bias->ndim()) +
                                "-D with " + std::to_string(bias->size()) + " values.");
  }
  const auto stream = mx::to_stream(s);
  const int64_t K = w.shape(1);
  const int64_t rows = K > 0 ? static_cast<int64_t>(x.size()) / K : 0;
  const bool ours = tuned_products_available() && stream.device == mx::Device::gpu && rows > 1 &&
                    rows <= kTunedMaxRows &&
                    w.shape(0) > 0 && K > 0 && tuned_dtype(x.dtype()) && x.dtype() == w.dtype() &&
                    (!bias || bias->dtype() == x.dtype());
#ifdef MLXI_CUBLAS
  if (ours) {
    auto xc = mx::contiguous(x, false, stream);  // shares the buffer when already row-contiguous
    auto wc = mx::contiguous(w, false, stream);
    std::vector<mx::array> inputs{xc, wc};
    if (bias) inputs.push_back(mx::contiguous(*bias, false, stream));
    auto shape = x.shape();
    shape.back() = w.shape(0);
    return mx::array(std::move(shape), x.dtype(), std::make_shared<TunedProduct>(stream), std::move(inputs));
  }
#else
  (void)ours;
#endif
  if (bias) {
    return mx::addmm(*bias, x, mx::transpose(w, stream), 1.0f, 1.0f, stream);
  }
  return mx::matmul(x, mx::transpose(w, stream), stream);
}

}  // namespace mlx_infer
