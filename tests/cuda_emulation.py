"""Run the CUDA kernels' source text on the CPU (tests/test_*_cuda_text.py).

The kernels of ``cpp/attention/paged_attention_cuda.cpp`` are strings that MLX's ``mx.fast.cuda_kernel``
wraps in a ``__global__`` function (inputs, outputs, then the template arguments as ``constexpr``
constants) and NVRTC compiles on the GPU. Here the same strings are wrapped the same way and compiled
by the host's g++ against stand-ins for the CUDA built-ins: one ``std::thread`` per CUDA thread of a
block, ``std::barrier`` for ``__syncthreads`` and for the warp shuffles (a warp's 32 lanes exchange
through a table between two barriers), blocks one after another. Float32 only (``QT = KT = OT = float``).
What it checks is the kernels' arithmetic and indexing (exp2 domain, soft cap, sinks, the split-K
partials and their merge), not NVRTC's or the GPU's behaviour.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

KERNEL_FILE = Path(__file__).resolve().parents[1] / "cpp" / "attention" / "paged_attention_cuda.cpp"
NUM_WARPS = 4  # kWarps of paged_attention_cuda.cpp

_MOCK = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct dim3_ { int x = 0, y = 0, z = 0; };
static dim3_ blockIdx, gridDim, blockDim;
static thread_local dim3_ threadIdx;
static std::barrier<>* g_block_bar;
static std::barrier<>* g_warp_bar[32];
static float g_shfl[32][32];
// exp2f, tanhf, fmaxf, INFINITY: the C library's (math.h), as CUDA's device library names them.
using std::max;
using std::min;
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_warp_bar[w]->arrive_and_wait();  // every lane has read the previous exchange
  g_shfl[w][l] = v;
  g_warp_bar[w]->arrive_and_wait();
  return g_shfl[w][l ^ o];
}
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
// Blocks run one after another: a fence orders nothing more, an "atomic" add by one thread of a block is exact.
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
inline float __ldcg(const float* p) { return *p; }
inline float __int_as_float(int bits) { float f; __builtin_memcpy(&f, &bits, sizeof f); return f; }
inline float __uint_as_float(uint32_t bits) { float f; __builtin_memcpy(&f, &bits, sizeof f); return f; }
template <typename T, int N> struct AlignedVector {
  T v[N];
  T operator[](int i) const { return v[i]; }
  T& operator[](int i) { return v[i]; }
};
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
struct Shape { int d[8]; int operator[](int i) const { return d[i]; } };
"""

_MAIN = r"""
template <typename F> void run_block(int threads, F f) {
  std::barrier<> bar(threads);
  for (int w = 0; w < (threads + 31) / 32; ++w) g_warp_bar[w] = new std::barrier<>(32);
  g_block_bar = &bar;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back([t, &f] { threadIdx.x = t; f(); });
  for (auto& t : ts) t.join();
  for (int w = 0; w < (threads + 31) / 32; ++w) delete g_warp_bar[w];
}
std::vector<char> slurp(const char* p) {
  std::vector<char> b;
  FILE* f = fopen(p, "rb");
  char c[65536];
  size_t n;
  while ((n = fread(c, 1, sizeof c, f)) > 0) b.insert(b.end(), c, c + n);
  fclose(f);
  return b;
}
int main() {
  auto q = slurp("q.bin"), k = slurp("k.bin"), v = slurp("v.bin"), tb = slurp("t.bin"), ln = slurp("l.bin"),
       sk = slurp("sk.bin");
  Shape qs{}, ts{};
  qs.d[0] = R, qs.d[1] = H, qs.d[2] = D;
  ts.d[0] = R, ts.d[1] = T;
  std::vector<float> out((size_t)R * H * D), part((size_t)SPLITS * R * H * D), ml((size_t)SPLITS * R * H * 2);
  std::vector<int32_t> counts((size_t)R * KVH, 0);
  auto *Q = (const float*)q.data(), *K = (const float*)k.data(), *V = (const float*)v.data();
  auto *TB = (const int32_t*)tb.data(), *LN = (const int32_t*)ln.data();
  auto *SK = (const float*)sk.data();
  gridDim = {SPLITS, KVH, R};
  blockDim = {32 * NW, 1, 1};
  for (int z = 0; z < R; ++z) for (int y = 0; y < KVH; ++y) for (int x = 0; x < SPLITS; ++x) {
    blockIdx = {x, y, z};
    if (SPLITS == 1) run_block(32 * NW, [&] { pass1_out(Q, qs, K, V, TB, ts, LN, SK, out.data()); });
    else if (ONE_PASS) run_block(32 * NW, [&] {
      pass1_one(Q, qs, K, V, TB, ts, LN, SK, counts.data(), out.data(), part.data(), ml.data());
    });
    else run_block(32 * NW, [&] { pass1_part(Q, qs, K, V, TB, ts, LN, SK, part.data(), ml.data()); });
  }
  if (SPLITS > 1 && !ONE_PASS) {
    Shape ps{};
    ps.d[0] = SPLITS, ps.d[1] = R, ps.d[2] = H, ps.d[3] = D;
    const int bx = std::min(D, 128);
    gridDim = {(D + bx - 1) / bx, H, R};
    blockDim = {bx, 1, 1};
    for (int z = 0; z < R; ++z) for (int y = 0; y < H; ++y) for (int x = 0; x < gridDim.x; ++x) {
      blockIdx = {x, y, z};
      for (int t = 0; t < bx; ++t) { threadIdx.x = t; pass2(part.data(), ps, ml.data(), SK, out.data()); }
    }
  }
  FILE* f = fopen("o.bin", "wb");
  fwrite(out.data(), 4, out.size(), f);
  fwrite(counts.data(), 4, counts.size(), f);  // the one-pass kernel leaves them zero
  fclose(f);
}
"""


def compiler() -> str | None:
    """The host C++ compiler that builds the emulation (g++ with C++20's <barrier>), or None."""
    return shutil.which("g++")


def build_and_run(workdir: Path, source: str) -> None:
    """Compile ``source`` (an emulation program) in ``workdir`` with the host's g++ and run it there."""
    (workdir / "emu.cpp").write_text(source)
    build = subprocess.run([compiler(), "-std=c++20", "-O1", "-pthread", "-w", "emu.cpp", "-o", "emu"],
                           cwd=workdir, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    subprocess.run(["./emu"], cwd=workdir, check=True, timeout=120)


def _sources() -> dict[str, str]:
    text = KERNEL_FILE.read_text()

    def raw(name: str) -> str:
        m = (re.search(r'constexpr const char\* %s = R"\((.*?)\)";' % name, text, re.S)
             or re.search(r'constexpr const char\* %s = "(.*?)";\n' % name, text, re.S))
        assert m is not None, f"{name} not found in {KERNEL_FILE}"
        return m.group(1)

    out = {n: raw(n) for n in ("kHeader", "kPass1", "kStoreOut", "kStorePart", "kPass2", "kSink", "kMergeTail")}
    assert out["kPass1"].count("MLXI_SINK") == 1 and out["kPass2"].count("MLXI_SINK") == 1
    assert out["kPass1"].count("MLXI_TAIL") == 1 and out["kMergeTail"].count("MLXI_SINK") == 1
    return out


def _function(name: str, args: str, consts: dict, body: str) -> str:
    """A kernel as mx.fast.cuda_kernel writes it: the signature, the template constants, the body."""
    lines = []
    for k, v in consts.items():
        lines.append(f"  using {k} = float;" if v is float else
                     f"  constexpr bool {k} = {'true' if v else 'false'};" if isinstance(v, bool) else
                     f"  constexpr int {k} = {v};")
    return f"void {name}({args}) {{\n" + "\n".join(lines) + f"\n{body}\n}}\n"


def float_bits(x: float) -> int:
    """A float32's bit pattern as an int: the kernels' kScaleBits-style template constants (kernel_args.h)."""
    return int(np.array([x], np.float32).view(np.int32)[0])


def program(R: int, H: int, KVH: int, D: int, P: int, T: int, window: int, splits: int, softcap: float,
            sinks: bool, unroll: int = 2, prefetch: bool = False, scale: float = 1.0, one_pass: bool = False) -> str:
    """The C++ program running pass 1 (and, split, pass 2 or, ``one_pass``, the merge inside pass 1) as
    paged_attention_cuda.cpp launches them."""
    s = _sources()
    pass1 = s["kPass1"].replace("MLXI_SINK", s["kSink"])
    tail = s["kMergeTail"].replace("MLXI_SINK", s["kSink"])
    pass2 = s["kPass2"].replace("MLXI_SINK", s["kSink"])
    lpk = min(32, D // 8)
    consts = dict(QT=float, KT=float, OT=float, kD=D, kP=P, kG=H // KVH, kKVH=KVH, kWindow=max(window, 0),
                  kNW=NUM_WARPS, kLPK=lpk, kE=D // lpk, kU=unroll, kPrefetch=prefetch, kSoftcap=softcap > 0,
                  kScaleBits=float_bits(scale), kCapBits=float_bits(max(softcap, 0.0)))
    common = ("const float* q, const Shape q_shape, const float* k, const float* v, const int32_t* block_tables, "
              "const Shape block_tables_shape, const int32_t* lengths, const float* sinks, ")
    sizes = (f"constexpr int R = {R}, H = {H}, KVH = {KVH}, D = {D}, T = {T}, SPLITS = {splits}, NW = {NUM_WARPS};\n"
             f"constexpr bool ONE_PASS = {'true' if one_pass else 'false'};\n")
    return (_MOCK + s["kHeader"] + sizes
            + _function("pass1_out", common + "float* out", {**consts, "kSinks": sinks and splits == 1},
                        pass1.replace("MLXI_STORE", s["kStoreOut"]).replace("MLXI_TAIL", ""))
            + _function("pass1_part", common + "float* o_part, float* ml", {**consts, "kSinks": False},
                        pass1.replace("MLXI_STORE", s["kStorePart"]).replace("MLXI_TAIL", ""))
            + _function("pass1_one", common + "const int32_t* counts, float* out, float* o_part, float* ml",
                        {**consts, "kSinks": False, "kMergeSinks": sinks},
                        pass1.replace("MLXI_STORE", s["kStorePart"]).replace("MLXI_TAIL", tail))
            + _function("pass2", "const float* o_part, const Shape o_part_shape, const float* ml, "
                        "const float* sinks, float* out", dict(OT=float, kD=D, kH=H, kSinks=sinks), pass2)
            + _MAIN)


def run(workdir: Path, q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, lengths: np.ndarray, *,
        window: int, scale: float, softcap: float, sinks: np.ndarray | None, splits: int, unroll: int = 2,
        prefetch: bool = False, one_pass: bool = False, counts_out: list | None = None) -> np.ndarray:
    """The kernels' output ``(R, H, D)`` float32 for float32 ``q (R, H, D)``, storage ``(pages, KVH, P, D)``;
    ``one_pass``: split-K with the merge inside pass 1 (the paged step's launch), whose split counters are
    appended to ``counts_out`` as the kernel left them."""
    R, H, D = q.shape
    KVH, P = k.shape[1], k.shape[2]
    workdir.mkdir(parents=True, exist_ok=True)
    for name, a in (("q", q), ("k", k), ("v", v), ("t", tables), ("l", lengths)):
        np.ascontiguousarray(a).tofile(workdir / f"{name}.bin")
    (np.zeros(1, np.float32) if sinks is None else sinks.astype(np.float32)).tofile(workdir / "sk.bin")
    build_and_run(workdir, program(R, H, KVH, D, P, tables.shape[1], window, splits, softcap,
                                   sinks is not None, unroll, prefetch, scale, one_pass))
    raw = np.fromfile(workdir / "o.bin", np.float32)
    if counts_out is not None:
        counts_out.append(raw[R * H * D:].view(np.int32).copy())
    return raw[: R * H * D].reshape(R, H, D)


ROPE_FILE = Path(__file__).resolve().parents[1] / "cpp" / "attention" / "qkv_rope_cuda.cpp"
KERNEL_ARGS_FILE = Path(__file__).resolve().parents[1] / "cpp" / "attention" / "kernel_args.h"

def _rope_main(extra_inputs: str, outputs: str, call_args: str, written: str) -> str:
    """The emulation's main() for qkv_rope's launch as rope_launch sizes it: grid (D / 2 over blocks of up to
    128 threads, or with QK_NORM one head's D / 2 rounded up to a warp; heads; rows), each block's threads run
    together (the norm's reduction), the kernel called with ``call_args`` after qkv, positions, freqs, q_w, k_w;
    then ``written`` to o.bin."""
    return ("int main() {\n"
            '  auto qkv = slurp("qkv.bin"), pos = slurp("pos.bin"), fr = slurp("fr.bin"), qw = slurp("qw.bin"),'
            ' kw = slurp("kw.bin");\n'
            + extra_inputs + outputs +
            """  const int half = D / 2, bx = QK_NORM ? (half + 31) / 32 * 32 : std::min(half, 128);
  gridDim = {(half + bx - 1) / bx, H + 2 * KVH, R};
  blockDim = {bx, 1, 1};
  for (int z = 0; z < gridDim.z; ++z) for (int y = 0; y < gridDim.y; ++y) for (int x = 0; x < gridDim.x; ++x) {
    blockIdx = {x, y, z};
    run_block(bx, [&] {
      qkv_rope((const float*)qkv.data(), (const int32_t*)pos.data(), (const float*)fr.data(),
               (const float*)qw.data(), (const float*)kw.data(), """
            + call_args + """);
    });
  }
  FILE* f = fopen("o.bin", "wb");
""" + written + "  fclose(f);\n}\n")


_ROPE_MAIN = _rope_main(
    "", "  std::vector<float> q((size_t)R * H * D), k((size_t)R * KVH * D), v((size_t)R * KVH * D);\n",
    "q.data(), k.data(), v.data()",
    "  fwrite(q.data(), 4, q.size(), f);\n  fwrite(k.data(), 4, k.size(), f);\n  fwrite(v.data(), 4, v.size(), f);\n")

_ROPE_WRITE_MAIN = _rope_main(
    '  auto sl = slurp("sl.bin"), kp = slurp("kp.bin"), vp = slurp("vp.bin");\n',
    "  std::vector<float> q((size_t)R * H * D);\n",
    "(const int32_t*)sl.data(), (const float*)kp.data(), (const float*)vp.data(), q.data()",
    "  fwrite(q.data(), 4, q.size(), f);\n  fwrite(kp.data(), 1, kp.size(), f);\n  fwrite(vp.data(), 1, vp.size(), f);\n")


def _rope_kernel(name: str) -> str:
    """The kernel text with MLXI_KV_DST replaced by the C++ constant ``name`` (kKvOut or kKvWrite)."""
    text = ROPE_FILE.read_text()
    m = re.search(r'constexpr const char\* kQkvRope = R"\((.*?)\)";', text, re.S)
    assert m is not None, f"kQkvRope not found in {ROPE_FILE}"
    d = (re.search(r'constexpr const char\* %s = R"\((.*?)\)";' % name, text, re.S)
         or re.search(r'constexpr const char\* %s = "(.*?)";\n' % name, text, re.S))
    assert d is not None, f"{name} not found in {ROPE_FILE}"
    assert m.group(1).count("MLXI_KV_DST") == 1
    return m.group(1).replace("MLXI_KV_DST", d.group(1))


def _rope_consts(H: int, KVH: int, D: int, dims: int, traditional: bool, base: float | None, scale: float,
                 freqs: np.ndarray | None, norms: tuple | None) -> dict:
    return dict(T=float, kH=H, kKVH=KVH, kD=D, kDims=dims, kTraditional=traditional, kFreqs=freqs is not None,
                kQkNorm=norms is not None,
                # scale and log2(base) in float32, as qkv_rope passes them (std::log2 of the float base)
                kScaleBits=float_bits(scale),
                kLog2BaseBits=float_bits(0.0 if base is None else float(np.log2(np.float32(base)))),
                kEpsBits=float_bits(0.0 if norms is None else norms[2]),
                kBlock=(D // 2 + 31) // 32 * 32 if norms is not None else min(D // 2, 128))  # rope_launch's block


def _rope_source(R: int, H: int, KVH: int, D: int, args: str, consts: dict, kv_dst: str, main: str) -> str:
    return (_MOCK + f"constexpr int R = {R}, H = {H}, KVH = {KVH}, D = {D};\n"
            + f"constexpr bool QK_NORM = {'true' if consts['kQkNorm'] else 'false'};\n"
            + _raw(KERNEL_ARGS_FILE, "kBlockSumHeader")
            + _function("qkv_rope", args, consts, _rope_kernel(kv_dst)) + _MAIN.split("int main()")[0] + main)


def _rope_files(workdir: Path, qkv: np.ndarray, positions: np.ndarray, freqs: np.ndarray | None,
                norms: tuple | None) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    np.ascontiguousarray(qkv, np.float32).tofile(workdir / "qkv.bin")
    np.ascontiguousarray(positions, np.int32).tofile(workdir / "pos.bin")
    (np.zeros(1, np.float32) if freqs is None else freqs.astype(np.float32)).tofile(workdir / "fr.bin")
    for name, w in (("qw", None if norms is None else norms[0]), ("kw", None if norms is None else norms[1])):
        (np.zeros(1, np.float32) if w is None else np.ascontiguousarray(w, np.float32)).tofile(workdir / f"{name}.bin")


_ROPE_ARGS = "const float* qkv, const int32_t* positions, const float* freqs, const float* q_w, const float* k_w, "


def run_qkv_rope_write(workdir: Path, qkv: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       k_pool: np.ndarray, v_pool: np.ndarray, *, H: int, KVH: int, D: int, dims: int,
                       traditional: bool, base: float | None, scale: float, freqs: np.ndarray | None,
                       norms: tuple | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """qkv_rope_cuda.cpp's writing kernel on the CPU: float32 ``qkv (R, (H + 2 KVH) D)``, each row's slot
    ``(R,)`` and the storage ``(pages, KVH, P, D)`` -> q ``(R, H, D)`` and the storage as the kernel left it.
    ``norms``: (q_w (D,), k_w (D,), eps), the per-head q/k RMSNorms."""
    R, P = qkv.shape[0], k_pool.shape[2]
    consts = {**_rope_consts(H, KVH, D, dims, traditional, base, scale, freqs, norms), "kP": P}
    args = _ROPE_ARGS + "const int32_t* slots, const float* k_pool, const float* v_pool, float* q_out"
    source = _rope_source(R, H, KVH, D, args, consts, "kKvWrite", _ROPE_WRITE_MAIN)
    _rope_files(workdir, qkv, positions, freqs, norms)
    np.ascontiguousarray(slots, np.int32).tofile(workdir / "sl.bin")
    np.ascontiguousarray(k_pool, np.float32).tofile(workdir / "kp.bin")
    np.ascontiguousarray(v_pool, np.float32).tofile(workdir / "vp.bin")
    build_and_run(workdir, source)
    out = np.fromfile(workdir / "o.bin", np.float32)
    nq, npool = R * H * D, k_pool.size
    return (out[:nq].reshape(R, H, D), out[nq:nq + npool].reshape(k_pool.shape),
            out[nq + npool:].reshape(v_pool.shape))


def run_qkv_rope(workdir: Path, qkv: np.ndarray, positions: np.ndarray, *, H: int, KVH: int, D: int, dims: int,
                 traditional: bool, base: float | None, scale: float, freqs: np.ndarray | None,
                 norms: tuple | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """qkv_rope_cuda.cpp's kernel on the CPU: float32 ``qkv (R, (H + 2 KVH) D)`` -> q, k, v ``(R, heads, D)``;
    ``norms`` as run_qkv_rope_write's."""
    R = qkv.shape[0]
    consts = _rope_consts(H, KVH, D, dims, traditional, base, scale, freqs, norms)
    args = _ROPE_ARGS + "float* q_out, float* k_out, float* v_out"
    source = _rope_source(R, H, KVH, D, args, consts, "kKvOut", _ROPE_MAIN)
    _rope_files(workdir, qkv, positions, freqs, norms)
    build_and_run(workdir, source)
    out = np.fromfile(workdir / "o.bin", np.float32)
    nq, nk = R * H * D, R * KVH * D
    return (out[:nq].reshape(R, H, D), out[nq:nq + nk].reshape(R, KVH, D), out[nq + nk:].reshape(R, KVH, D))


GEMV_FILE = Path(__file__).resolve().parents[1] / "cpp" / "matmul" / "gemv_cuda.cpp"
GEMV_COMMON_FILE = GEMV_FILE.parent / "gemv_common.h"  # kMmaStore: the tensor-core forms' last part

def _gemv_main(blocks: str, call: str) -> str:
    """main() of a GEMV kernel's emulation: ``blocks`` blocks of 32 x NWB threads one after another, each thread
    running ``call`` (over x.bin, w.bin, s.bin, b.bin as xb, wb, sb, bb and their shapes xs (M, K), ws (N, WK)),
    y (M, N) float32 into o.bin."""
    return r"""
int main() {
  auto xb = slurp("x.bin"), wb = slurp("w.bin"), sb = slurp("s.bin"), bb = slurp("b.bin");
  Shape xs{}, ws{};
  xs.d[0] = M, xs.d[1] = K;
  ws.d[0] = N, ws.d[1] = WK;
  std::vector<float> y((size_t)M * N, -12345.0f);
  const int blocks = BLOCKS;
  gridDim = {blocks, 1, 1};
  blockDim = {32 * NWB, 1, 1};
  for (int x = 0; x < blocks; ++x) {
    blockIdx = {x, 0, 0};
    run_block(32 * NWB, [&] { CALL; });
  }
  FILE* f = fopen("o.bin", "wb");
  fwrite(y.data(), 4, y.size(), f);
  fclose(f);
}
""".replace("BLOCKS", blocks).replace("CALL", call)


CORE_BLOCKS = "(((N + RPW - 1) / RPW) + NWB - 1) / NWB"  # the CUDA-core forms: RPW rows of w a warp, NWB warps a block
MMA_BLOCKS = "(N + 8 * RPW - 1) / (8 * RPW)"  # the tensor-core forms: RPW n-tiles of 8 rows of w a block


def _run_gemv_source(workdir: Path, name: str, args: str, consts: dict, body: str, mocks: str, main: str,
                     sizes: dict, files: dict[str, np.ndarray]) -> np.ndarray:
    """Build ``body`` as kernel ``name`` with ``mocks`` and ``main``, write ``files`` (name -> array in its dtype),
    run it, and return y (M, N)."""
    tail = mocks + _MAIN.split("int main()")[0]
    consts_text = "".join(f"constexpr int {k} = {v};\n" for k, v in sizes.items())
    source = _MOCK + consts_text + tail + _function(name, args, consts, body) + main
    workdir.mkdir(parents=True, exist_ok=True)
    for f in ("x", "w", "s", "b"):
        np.ascontiguousarray(files.get(f, np.zeros(1, np.float32))).tofile(workdir / f"{f}.bin")
    build_and_run(workdir, source)
    return np.fromfile(workdir / "o.bin", np.float32).reshape(sizes["M"], sizes["N"])


# The tensor-core form's fragments and mma.sync m16n8k16 (row.col, float32 accumulation), per warp: every lane
# posts its A (4 pairs) and B (2 pairs) fragments, then computes its own 4 elements of D = A B + C from them.
_MMA_MOCK = r"""
struct MlxiFrag { float lo = 0.0f, hi = 0.0f; };
template <typename V> MlxiFrag mlxi_pair(const V& v, int j) { return {v[2 * j], v[2 * j + 1]}; }
inline MlxiFrag mlxi_zero_pair() { return {}; }
static MlxiFrag g_fa[32][32][4], g_fb[32][32][2];
inline void mlxi_mma(const float*, float* c, const MlxiFrag* a, const MlxiFrag* b) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  g_warp_bar[w]->arrive_and_wait();  // every lane has read the previous fragments
  for (int j = 0; j < 4; ++j) g_fa[w][l][j] = a[j];
  for (int j = 0; j < 2; ++j) g_fb[w][l][j] = b[j];
  g_warp_bar[w]->arrive_and_wait();
  auto A = [&](int r, int k) {
    const MlxiFrag f = g_fa[w][(r % 8) * 4 + (k % 8) / 2][(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
    return k % 2 ? f.hi : f.lo;
  };
  auto B = [&](int k, int n) {
    const MlxiFrag f = g_fb[w][n * 4 + (k % 8) / 2][k >= 8 ? 1 : 0];
    return k % 2 ? f.hi : f.lo;
  };
  const int g = l / 4, t = l % 4;
  for (int j = 0; j < 4; ++j) {
    const int r = g + (j >= 2 ? 8 : 0), n = 2 * t + (j & 1);
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, n);
    c[j] += sum;
  }
}
"""

def run_gemv(workdir: Path, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, *, rows_per_warp: int,
             warps: int, unroll: int, mma: bool = False) -> np.ndarray:
    """gemv_cuda.cpp's kernel on the CPU, as skinny_linear launches it: float32 ``x (M, K) @ w (N, K).T (+ bias)``;
    ``mma``: the tensor-core form (its fragments and mma.sync emulated in float32)."""
    M, K = x.shape
    N = w.shape[0]
    sizes = dict(M=M, N=N, K=K, WK=K, RPW=rows_per_warp, NWB=warps)
    files = {"x": x.astype(np.float32), "w": w.astype(np.float32)}
    if bias is not None:
        files["b"] = bias.astype(np.float32)
    if mma:
        body = _raw(GEMV_FILE, "kMmaSource") + _raw(GEMV_COMMON_FILE, "kMmaStore")
        consts = dict(T=float, kMT=-(-M // 16), kNT=rows_per_warp, kNW=warps, kU=unroll, kBias=bias is not None)
        args = "const float* x, const Shape x_shape, const float* w, const Shape w_shape, const float* bias, float* y"
        main = _gemv_main(MMA_BLOCKS, "gemv((const float*)xb.data(), xs, (const float*)wb.data(), ws, "
                                      "(const float*)bb.data(), y.data())")
        return _run_gemv_source(workdir, "gemv", args, consts, body, _MMA_MOCK, main, sizes, files)
    consts = dict(T=float, kM=M, kR=rows_per_warp, kNW=warps, kU=unroll, kBias=bias is not None)
    args = "const float* x, const float* w, const Shape w_shape, const float* bias, float* y"
    main = _gemv_main(CORE_BLOCKS, "gemv((const float*)xb.data(), (const float*)wb.data(), ws, "
                                   "(const float*)bb.data(), y.data())")
    return _run_gemv_source(workdir, "gemv", args, consts, _raw(GEMV_FILE, "kSource"), "", main, sizes, files)


QGEMV_FILE = Path(__file__).resolve().parents[1] / "cpp" / "matmul" / "qgemv_cuda.cpp"

# The tensor-core form's helpers (qgemv_cuda.cpp's kQMmaHeader) on _MMA_MOCK's float fragments.
_QMMA_MOCK = r"""
template <typename V> void mlxi_x_pairs(const V& v, MlxiFrag* p) { for (int j = 0; j < 4; ++j) p[j] = {v[j], v[j + 4]}; }
inline MlxiFrag mlxi_pack(const float*, float lo, float hi) { return {lo, hi}; }
inline void mlxi_dequant4(const float*, uint32_t w, float s, float b, MlxiFrag* p) {
  auto q = [&](int i) { return float((w >> (4 * i)) & 0xFu); };
  for (int j = 0; j < 4; ++j) p[j] = {std::fma(s, q(j), b), std::fma(s, q(j + 4), b)};
}
"""


def run_qgemv(workdir: Path, x: np.ndarray, wq: np.ndarray, scales: np.ndarray, biases: np.ndarray, *, bits: int,
              group_size: int, rows_per_warp: int, warps: int, unroll: int, mma: bool = False) -> np.ndarray:
    """qgemv_cuda.cpp's kernel on the CPU, as quantized_gemv launches it: float32 ``x (M, K)`` times MLX's affine
    ``wq (N, K bits / 32)`` uint32 with float32 ``scales``, ``biases`` (N, K / group_size), transposed; ``mma``:
    the tensor-core form (fragments and mma.sync emulated in float32, so the dequantized weights are not rounded)."""
    M, K = x.shape
    N, KW = wq.shape
    sizes = dict(M=M, N=N, K=K, WK=KW, RPW=rows_per_warp, NWB=warps)
    files = {"x": x.astype(np.float32), "w": wq.astype(np.uint32), "s": scales.astype(np.float32),
             "b": biases.astype(np.float32)}
    w_args = "const uint32_t* w, const Shape w_shape, const float* scales, const float* biases, float* y"
    w_call = "(const uint32_t*)wb.data(), ws, (const float*)sb.data(), (const float*)bb.data(), y.data())"
    if mma:
        body = _raw(QGEMV_FILE, "kQMmaSource") + _raw(GEMV_COMMON_FILE, "kMmaStore")
        consts = dict(T=float, kBits=bits, kG=group_size, kMT=-(-M // 16), kNT=rows_per_warp, kNW=warps, kU=unroll)
        main = _gemv_main(MMA_BLOCKS, "qgemv((const float*)xb.data(), xs, " + w_call)
        return _run_gemv_source(workdir, "qgemv", "const float* x, const Shape x_shape, " + w_args, consts, body,
                                _MMA_MOCK + _QMMA_MOCK, main, sizes, files)
    consts = dict(T=float, kBits=bits, kG=group_size, kM=M, kR=rows_per_warp, kNW=warps, kU=unroll)
    main = _gemv_main(CORE_BLOCKS, "qgemv((const float*)xb.data(), " + w_call)
    return _run_gemv_source(workdir, "qgemv", "const float* x, " + w_args, consts, _raw(QGEMV_FILE, "kSource"), "",
                            main, sizes, files)


FUSED_DIR = Path(__file__).resolve().parents[1] / "cpp" / "fused"


def _raw(path: Path, name: str) -> str:
    m = re.search(r'constexpr const char\* %s = R"\((.*?)\)";' % name, path.read_text(), re.S)
    assert m is not None, f"{name} not found in {path}"
    return m.group(1)


_ROWS_MAIN = r"""
int main() {
  auto a = slurp("a.bin"), b = slurp("b.bin"), c = slurp("c.bin"), d = slurp("d.bin");
  std::vector<float> o1((size_t)R * OUT1, -12345.0f), o2((size_t)R * OUT2, -12345.0f);
  gridDim = {GX, R, 1};
  blockDim = {BLOCK, 1, 1};
  for (int y = 0; y < R; ++y) for (int x = 0; x < GX; ++x) {
    blockIdx = {x, y, 0};
    run_block(BLOCK, [&] { KERNEL_CALL; });
  }
  FILE* f = fopen("o.bin", "wb");
  fwrite(o1.data(), 4, o1.size(), f);
  fwrite(o2.data(), 4, o2.size(), f);
  fclose(f);
}
"""


def _run_rows(workdir: Path, kernel: str, header: str, call: str, sizes: dict, arrays: list[np.ndarray]) -> np.ndarray:
    """A kernel of a (x, row) grid, blocks one after another; a, b, c, d the input files; o1 then o2 come back."""
    consts = "".join(f"constexpr int {k} = {v};\n" for k, v in sizes.items())
    main = _ROWS_MAIN.replace("KERNEL_CALL", call)
    source = _MOCK + consts + header + kernel + _MAIN.split("int main()")[0] + main
    workdir.mkdir(parents=True, exist_ok=True)
    for name, arr in zip("abcd", arrays + [np.zeros(1, np.float32)] * (4 - len(arrays))):
        np.ascontiguousarray(arr, np.float32).tofile(workdir / f"{name}.bin")
    build_and_run(workdir, source)
    return np.fromfile(workdir / "o.bin", np.float32)


def run_add_rms_norm(workdir: Path, h: np.ndarray, r: np.ndarray, w: np.ndarray, eps: float, *, block: int,
                     per: int, pre_w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """residual_norm_cuda.cpp's kernel on the CPU, launched as add_rms_norm launches it (float32); ``pre_w``:
    the sandwich norm's weight (r normed by it before the add)."""
    R, E = h.shape
    body = _raw(FUSED_DIR / "residual_norm_cuda.cpp", "kAddRmsNorm")
    header = _raw(KERNEL_ARGS_FILE, "kBlockSumHeader")
    consts = dict(T=float, kE=E, kBlock=block, kPer=per, kEpsBits=float_bits(eps), kPreNorm=pre_w is not None,
                  kClip=False)
    kernel = _function("add_rms_norm", "const float* h, const float* r, const float* w, const float* pw, "
                       "float* sum_out, float* norm_out", consts, body)
    out = _run_rows(workdir, kernel, header, "add_rms_norm((const float*)a.data(), (const float*)b.data(), "
                    "(const float*)c.data(), (const float*)d.data(), o1.data(), o2.data())",
                    dict(R=R, OUT1=E, OUT2=E, GX=1, BLOCK=block), [h, r, w, w if pre_w is None else pre_w])
    return out[:R * E].reshape(R, E), out[R * E:].reshape(R, E)


def run_gated(workdir: Path, gate_up: np.ndarray, activation: str, *, block: int) -> np.ndarray:
    """gated_cuda.cpp's kernel on the CPU, launched as gated_activation launches it (float32)."""
    R, F2 = gate_up.shape
    F = F2 // 2
    path = FUSED_DIR / "gated_cuda.cpp"
    header = _raw(path, "kGatedHeader").replace("__device__ __forceinline__", "inline")
    consts = dict(T=float, kF=F, kGelu=activation == "gelu_tanh")
    kernel = _function("gated", "const float* gate_up, float* out", consts, _raw(path, "kGated"))
    blocks = -(-(F // 4) // block)
    out = _run_rows(workdir, kernel, header, "gated((const float*)a.data(), o1.data())",
                    dict(R=R, OUT1=F, OUT2=0, GX=blocks, BLOCK=block), [gate_up])
    return out[:R * F].reshape(R, F)
