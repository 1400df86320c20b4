// prefetch_to_gpu: move a host-made array's pages to the GPU before a kernel faults them in.
//
// MLX's CUDA allocator keeps an array made from host data (a step plan) in managed memory that the CPU
// wrote; the first kernel to touch it takes a page fault that migrates it (0.14-0.24 ms a step on the
// H200, benchmarks/gpu_host_arrays.py). A prefetch issued when the plan is made moves the pages while the
// host builds the step's graph. It is a hint only: managed memory stays coherent, so a kernel that runs
// before the prefetch ends still reads the right values (it just faults), and a buffer that is not
// managed (the prefetch fails) is left alone.
//
// The CUDA driver's entry points are looked up in the libcuda.so.1 that libmlx has already loaded
// (dlopen RTLD_NOLOAD): nothing is linked, and where there is no CUDA driver nothing happens.
// MLX_INFER_PREFETCH_PLAN=0 turns it off (read at each call: benchmarks/served.py --no-prefetch flips it).
#include <mlx/mlx.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <dlfcn.h>
#endif

#include "mlx_infer/backend.h"
#include "mlx_infer/kv.h"

namespace mlx_infer {

namespace {

#if defined(__linux__)
// The driver API's types, as cuda.h declares them (ABI-stable).
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUstream = void*;
struct CUmemLocation {
  int type;  // CUmemLocationType: 1 = CU_MEM_LOCATION_TYPE_DEVICE
  int id;    // the device ordinal
};
constexpr int kLocationDevice = 1;
constexpr unsigned kStreamNonBlocking = 1;

struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  // CUDA >= 12.2 (every driver MLX's CUDA wheels run on): location + flags.
  CUresult (*prefetch_v2)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream) = nullptr;
  // Older drivers: the destination device.
  CUresult (*prefetch_v1)(CUdeviceptr, size_t, CUdevice, CUstream) = nullptr;
  CUstream stream = nullptr;
  CUdevice device = 0;
  int ordinal = 0;
  bool ok = false;
};

template <typename F>
void resolve(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
}

std::atomic<bool> disabled{false};
std::mutex error_mutex;
std::string last_error = "";  // guarded by error_mutex

void fail(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(error_mutex);
    last_error = what;
  }
  disabled.store(true);
}

// Made once, on the first prefetch, on whichever thread makes it.
Driver* driver() {
  static Driver* d = []() -> Driver* {
    if (!cuda_backend()) return nullptr;
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) {
      fail("libcuda.so.1 is not loaded");
      return nullptr;
    }
    auto* dr = new Driver;
    resolve(lib, "cuInit", dr->init);
    resolve(lib, "cuDeviceGet", dr->device_get);
    resolve(lib, "cuCtxGetCurrent", dr->ctx_get_current);
    resolve(lib, "cuCtxSetCurrent", dr->ctx_set_current);
    resolve(lib, "cuDevicePrimaryCtxRetain", dr->primary_ctx_retain);
    resolve(lib, "cuStreamCreate", dr->stream_create);
    resolve(lib, "cuMemPrefetchAsync_v2", dr->prefetch_v2);
    if (!dr->prefetch_v2) resolve(lib, "cuMemPrefetchAsync", dr->prefetch_v1);
    if (!dr->init || !dr->device_get || !dr->ctx_get_current || !dr->ctx_set_current ||
        !dr->primary_ctx_retain || !dr->stream_create || (!dr->prefetch_v2 && !dr->prefetch_v1)) {
      fail("the CUDA driver lacks an entry point prefetch_to_gpu needs");
      return nullptr;
    }
    dr->ordinal = mx::default_device().index;
    if (CUresult r = dr->init(0); r != 0) {
      fail("cuInit failed (CUresult " + std::to_string(r) + ")");
      return nullptr;
    }
    if (CUresult r = dr->device_get(&dr->device, dr->ordinal); r != 0) {
      fail("cuDeviceGet failed (CUresult " + std::to_string(r) + ")");
      return nullptr;
    }
    dr->ok = true;
    return dr;
  }();
  return d;
}

// The primary context (the one MLX's runtime uses) current on this thread, and the prefetch stream.
bool ready(Driver& d) {
  thread_local bool current = false;
  if (!current) {
    CUcontext ctx = nullptr;
    if (CUresult r = d.ctx_get_current(&ctx); r != 0) {
      fail("cuCtxGetCurrent failed (CUresult " + std::to_string(r) + ")");
      return false;
    }
    if (!ctx) {
      if (CUresult r = d.primary_ctx_retain(&ctx, d.device); r != 0) {
        fail("cuDevicePrimaryCtxRetain failed (CUresult " + std::to_string(r) + ")");
        return false;
      }
      if (CUresult r = d.ctx_set_current(ctx); r != 0) {
        fail("cuCtxSetCurrent failed (CUresult " + std::to_string(r) + ")");
        return false;
      }
    }
    current = true;
  }
  static std::once_flag once;
  std::call_once(once, [&d]() {
    // Non-blocking: no ordering with MLX's streams (the prefetch is a hint; the data is already written).
    if (CUresult r = d.stream_create(&d.stream, kStreamNonBlocking); r != 0) {
      fail("cuStreamCreate failed (CUresult " + std::to_string(r) + ")");
    }
  });
  return !disabled.load();
}
#endif

}  // namespace

bool prefetch_to_gpu(const mx::array& a) {
  if (a.status() != mx::array::Status::available) {
    throw std::invalid_argument("[prefetch_to_gpu] the array must be evaluated (made from host data, or mx.eval it).");
  }
#if defined(__linux__)
  // <= 8 bytes: MLX's small pool, pages shared by many buffers the CPU writes and the GPU reads in place.
  if (disabled.load() || a.nbytes() <= 8) return false;
  const char* env = std::getenv("MLX_INFER_PREFETCH_PLAN");  // read each call: an A/B flips it in one process
  if (env && std::strcmp(env, "0") == 0) return false;
  Driver* d = driver();
  if (!d || !d->ok || !ready(*d)) return false;
  const auto ptr = reinterpret_cast<CUdeviceptr>(a.data<void>());
  CUresult r = d->prefetch_v2 ? d->prefetch_v2(ptr, a.nbytes(), CUmemLocation{kLocationDevice, d->ordinal}, 0,
                                               d->stream)
                              : d->prefetch_v1(ptr, a.nbytes(), d->device, d->stream);
  if (r != 0) {
    // Not managed memory (a device buffer from MLX's cache) or no concurrent managed access: never again.
    fail("cuMemPrefetchAsync failed (CUresult " + std::to_string(r) + ")");
    return false;
  }
  return true;
#else
  (void)a;
  return false;
#endif
}

std::string prefetch_error() {
#if defined(__linux__)
  std::lock_guard<std::mutex> lock(error_mutex);
  return last_error;
#else
  return "";
#endif
}

}  // namespace mlx_infer
