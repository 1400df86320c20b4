// Which MLX backend the process runs on, and the limits of its kernels the C++ graphs work around.
#pragma once

namespace mlx_infer {

/// True where MLX's CUDA backend is available (a Linux wheel with an NVIDIA GPU).
bool cuda_backend();

/// Rows per ``mx::fast::rope`` call so MLX's CUDA kernel launches: MLX 0.32's general RoPE kernel
/// (per-row offsets, ``mlx/backend/cuda/rope.cu``) sizes its block over (dims / 2, T, B * ceil(N / 4))
/// with up to 1024 threads and no cap on the z extent, so with ``dims < 32`` and 128 or more
/// (row, 4 heads) groups the block's z extent exceeds CUDA's 64 and the launch is refused
/// ("cudaLaunchKernelExC / cudaGraphAddKernelNode ... invalid argument"). Returns ``B`` where one call
/// is fine (and on every other backend: ``cuda`` false), else the most rows a call can take.
int rope_rows_per_call(int B, int heads, int T, int dims, bool cuda = cuda_backend());

}  // namespace mlx_infer
