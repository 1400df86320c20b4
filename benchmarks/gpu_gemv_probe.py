"""H200 probe: MLX's bf16 matmul at M=1/8 vs a warp-per-row GEMV custom CUDA kernel.

Run on a CUDA machine with mlx (CUDA) importable: python benchmarks/gpu_gemv_probe.py.
Findings are in benchmarks/RESULTS.md (H200 section) and results/h200-gemv-probe.txt.
"""
import time, sys
import mlx.core as mx

SRC = r"""
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int row0 = warp * R;
    if (row0 >= N) return;
    constexpr int K8 = K / 8;
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    #pragma unroll UNROLL
    for (int i = lane; i < K8; i += 32) {
      uint4 wv[R];
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = min(row0 + r, N - 1);
        wv[r] = __ldg(reinterpret_cast<const uint4*>(w) + (size_t)row * K8 + i);
      }
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        uint4 xv = xr[m * K8 + i];
        const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
        float2 xf[4];
        #pragma unroll
        for (int j = 0; j < 4; ++j) xf[j] = __bfloat1622float2(xp[j]);
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv[r]);
          #pragma unroll
          for (int j = 0; j < 4; ++j) {
            float2 wf = __bfloat1622float2(wp[j]);
            acc[r][m] = fmaf(wf.x, xf[j].x, acc[r][m]);
            acc[r][m] = fmaf(wf.y, xf[j].y, acc[r][m]);
          }
        }
      }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = acc[r][m];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if (lane == 0 && row0 + r < N) y[m * N + row0 + r] = __float2bfloat16(v);
      }
    }
"""

def make(unroll):
    return mx.fast.cuda_kernel(name=f"gemv_u{unroll}", input_names=["x", "w"], output_names=["y"],
                               source=SRC.replace("UNROLL", str(unroll)), header="#include <cuda_bf16.h>\n")

KERNELS = {u: make(u) for u in (4, 8)}

def gemv(x, w, R=1, warps=4, unroll=4):
    M, K = x.shape; N = w.shape[0]
    nwarps = (N + R - 1) // R
    return KERNELS[unroll](inputs=[x, w], template=[("M", M), ("K", K), ("N", N), ("R", R)],
                           grid=(nwarps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
                           output_shapes=[(M, N)], output_dtypes=[mx.bfloat16])[0]

def bench(fn, xs, ws, reps=20):
    n = len(ws)
    mx.eval(fn(xs, ws[0]))
    times = []
    for _ in range(5):
        mx.synchronize(); t0 = time.perf_counter()
        out = []
        for r in range(reps):
            out.append(fn(xs, ws[r % n]))
        mx.eval(out); mx.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return sorted(times)[2]

shapes = {"8b.qo": (4096, 4096), "8b.kv": (4096, 1024), "8b.gate": (4096, 14336), "8b.down": (14336, 4096),
          "8b.head": (4096, 128256), "1b.q": (2048, 2048), "1b.kv": (2048, 512), "1b.gate": (2048, 8192),
          "1b.down": (8192, 2048), "270m.q": (640, 1024), "270m.gate": (640, 2048), "270m.down": (2048, 640),
          "270m.head": (640, 262144)}
print("device", mx.default_device(), mx.__version__)
for name, (K, N) in shapes.items():
    copies = max(2, int(2e9 // (K * N * 2)) if K * N * 2 < 2e9 else 2)
    copies = min(copies, 16)
    ws = [mx.random.normal((N, K)).astype(mx.bfloat16) * 0.02 for _ in range(copies)]
    mx.eval(ws)
    for M in (1, 8):
        x = mx.random.normal((M, K)).astype(mx.bfloat16)
        ref = (x.astype(mx.float32) @ ws[0].astype(mx.float32).T)
        t_mlx = bench(lambda a, b: a @ b.T, x, ws)
        line = f"{name:10s} M={M} K={K:6d} N={N:7d}  mlx {t_mlx*1e6:8.1f}us {K*N*2/t_mlx/1e12:5.2f}TB/s"
        best = None
        for R in (1, 2):
            for warps in (4, 8):
                for u in (4, 8):
                    try:
                        y = gemv(x, ws[0], R, warps, u)
                        err = float(mx.abs(y.astype(mx.float32) - ref).max() / (mx.abs(ref).max() + 1e-9))
                        t = bench(lambda a, b: gemv(a, b, R, warps, u), x, ws)
                    except Exception as e:
                        print("ERR", name, M, R, warps, u, repr(e)[:300]); continue
                    if best is None or t < best[0]:
                        best = (t, R, warps, u, err)
        if best:
            t, R, warps, u, err = best
            line += f"  gemv {t*1e6:8.1f}us {K*N*2/t/1e12:5.2f}TB/s (R={R} W={warps} U={u} relerr={err:.1e})  speedup {t_mlx/t:4.2f}x"
        print(line, flush=True)
        del x
    del ws; mx.clear_cache()
