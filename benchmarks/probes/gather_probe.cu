// Measurement kernel for benchmarks/probes/bench_floor.py (not used by the ops, not shipped): the
// fastest way we know to gather whole rows of a bf16 table by index lists, with no arithmetic but
// the sum.
//
//   out[t] = sum_{p in [off[t], off[t+1])} (a[idx[p]] + b[idx[p]])      (b optional)
//
// Every sparse FFN kernel of this project must at least move these bytes (one weight row of
// W_up and of W_down^T per active (token, neuron) pair, or one x / dy row per pair in the
// weight-gradient passes), so its best time over the configurations below is a floor for them.
// TPR threads own one output row, each VEC 16-byte chunks of it; UNROLL listed rows are in
// flight per thread (index loads first, then every row load before any use). fp32 sums.
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

namespace {

constexpr int BLOCK = 256;

__device__ __forceinline__ void add8(float* acc, const uint4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

template <int TPR, int VEC, int UNROLL, bool TWO>
__global__ void __launch_bounds__(BLOCK) gather_sum_kernel(
    const uint4* __restrict__ a, const uint4* __restrict__ b, const int* __restrict__ off,
    const int* __restrict__ idx, int rows_out, int c8, uint4* __restrict__ out) {
  const int t = blockIdx.x * (BLOCK / TPR) + threadIdx.x / TPR;
  const int lane = threadIdx.x % TPR;
  if (t >= rows_out) return;
  float acc[VEC][8];
#pragma unroll
  for (int j = 0; j < VEC; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
  const int lo = off[t], hi = off[t + 1];
  for (int p0 = lo; p0 < hi; p0 += UNROLL) {
    int r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) r[u] = (p0 + u < hi) ? __ldg(idx + p0 + u) : -1;
    uint4 va[UNROLL][VEC], vb[UNROLL][VEC];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const long long o = (long long)r[u] * c8 + lane + j * TPR;
        va[u][j] = r[u] >= 0 ? __ldg(a + o) : make_uint4(0, 0, 0, 0);
        if (TWO) vb[u][j] = r[u] >= 0 ? __ldg(b + o) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        add8(acc[j], va[u][j]);
        if (TWO) add8(acc[j], vb[u][j]);
      }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[j][2 * i], acc[j][2 * i + 1]);
    out[(long long)t * c8 + lane + j * TPR] = v;
  }
}

template <int TPR, int UNROLL, bool TWO>
void launch_vec(int vec, const uint4* a, const uint4* b, const int* off, const int* idx, int rows_out,
                int c8, uint4* out, cudaStream_t s) {
  const int grid = (rows_out + BLOCK / TPR - 1) / (BLOCK / TPR);
  switch (vec) {
    case 1: gather_sum_kernel<TPR, 1, UNROLL, TWO><<<grid, BLOCK, 0, s>>>(a, b, off, idx, rows_out, c8, out); break;
    case 2: gather_sum_kernel<TPR, 2, UNROLL, TWO><<<grid, BLOCK, 0, s>>>(a, b, off, idx, rows_out, c8, out); break;
    case 4: gather_sum_kernel<TPR, 4, UNROLL, TWO><<<grid, BLOCK, 0, s>>>(a, b, off, idx, rows_out, c8, out); break;
    default: TORCH_CHECK(false, "gather_sum: columns / 8 / threads_per_row must be 1, 2 or 4, got ", vec);
  }
}

template <int TPR, bool TWO>
void launch_unroll(int unroll, int vec, const uint4* a, const uint4* b, const int* off, const int* idx,
                   int rows_out, int c8, uint4* out, cudaStream_t s) {
  switch (unroll) {
    case 2: launch_vec<TPR, 2, TWO>(vec, a, b, off, idx, rows_out, c8, out, s); break;
    case 4: launch_vec<TPR, 4, TWO>(vec, a, b, off, idx, rows_out, c8, out, s); break;
    case 8: launch_vec<TPR, 8, TWO>(vec, a, b, off, idx, rows_out, c8, out, s); break;
    default: TORCH_CHECK(false, "gather_sum: unroll must be 2, 4 or 8, got ", unroll);
  }
}

template <bool TWO>
void launch_tpr(int tpr, int unroll, int vec, const uint4* a, const uint4* b, const int* off,
                const int* idx, int rows_out, int c8, uint4* out, cudaStream_t s) {
  switch (tpr) {
    case 64: launch_unroll<64, TWO>(unroll, vec, a, b, off, idx, rows_out, c8, out, s); break;
    case 128: launch_unroll<128, TWO>(unroll, vec, a, b, off, idx, rows_out, c8, out, s); break;
    case 256: launch_unroll<256, TWO>(unroll, vec, a, b, off, idx, rows_out, c8, out, s); break;
    default: TORCH_CHECK(false, "gather_sum: threads_per_row must be 64, 128 or 256, got ", tpr);
  }
}

}  // namespace

// a, b: [R, C] bf16 (b may be empty: one table); off: [T + 1] int32; idx: [off[T]] int32 in
// [0, R); out: [T, C] bf16; stream: the CUDA stream's handle. C / 8 / threads_per_row in {1, 2, 4}.
void gather_sum(torch::Tensor a, torch::Tensor b, torch::Tensor off, torch::Tensor idx, torch::Tensor out,
                int64_t threads_per_row, int64_t unroll, int64_t stream) {
  TORCH_CHECK(a.is_cuda() && a.dim() == 2 && a.scalar_type() == torch::kBFloat16 && a.is_contiguous(),
              "gather_sum: a must be a contiguous 2-d CUDA bf16 tensor");
  const bool two = b.numel() > 0;
  if (two) TORCH_CHECK(b.sizes() == a.sizes() && b.scalar_type() == a.scalar_type() && b.is_contiguous(),
                       "gather_sum: b must match a");
  TORCH_CHECK(off.scalar_type() == torch::kInt32 && idx.scalar_type() == torch::kInt32, "gather_sum: off, idx int32");
  const int c = a.size(1);
  TORCH_CHECK(c % 8 == 0, "gather_sum: columns must be a multiple of 8");
  const int rows_out = off.numel() - 1;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows_out && out.size(1) == c && out.is_contiguous() &&
              out.scalar_type() == torch::kBFloat16, "gather_sum: out must be [T, C] bf16");
  const int c8 = c / 8;
  TORCH_CHECK(c8 % threads_per_row == 0, "gather_sum: columns / 8 must be a multiple of threads_per_row");
  const int vec = c8 / threads_per_row;
  auto s = reinterpret_cast<cudaStream_t>(stream);   // torch.cuda.current_stream().cuda_stream
  auto pa = reinterpret_cast<const uint4*>(a.data_ptr());
  auto pb = two ? reinterpret_cast<const uint4*>(b.data_ptr()) : pa;
  auto po = reinterpret_cast<uint4*>(out.data_ptr());
  if (two)
    launch_tpr<true>(threads_per_row, unroll, vec, pa, pb, off.data_ptr<int>(), idx.data_ptr<int>(), rows_out, c8, po, s);
  else
    launch_tpr<false>(threads_per_row, unroll, vec, pa, pb, off.data_ptr<int>(), idx.data_ptr<int>(), rows_out, c8, po, s);
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "gather_sum: launch failed: ", cudaGetErrorString(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_sum", &gather_sum, "out[t] = sum of rows a[idx] (+ b[idx]) listed for t (bench_floor.py)");
}
