// Down projection of the per-row TwELL path, split by output columns (issue 3).
//
//   y[t, c0:c0+C] = sum_p h[t, p] * W_down^T[n[t, p], c0:c0+C] (+ b_down[c0:c0+C])
//
// One block per C-column slice of K_out: the slice of W_down^T ([N, C], 176-180 KB at N=5632,
// C=16 or N=11008, C=8) is copied to shared memory once, then the block's 32 warps walk the
// tokens. The per-pair alternative (the fused row kernel) gathers a 4 KB W_down^T row from L2 per
// active pair: 1.9 GB at M=16384, d=0.005; here W_down is read once and each pair costs a 4-entry
// list read (pairs x 4 B x K_out / C from L2).
//
// Inputs: lst [M, W] int32, entry p of row t = (column << 16) | bits(h) in the weight dtype
// (written by twell_rows_kernel's SPLIT mode), nl [M] int32 = listed pairs of row t, or -1 for a
// row the row kernel finished itself (its y row is left untouched here).
//
// Lanes: LPT = C / 4 lanes per token, 4 columns each (fp32 accumulators); a token's entries are
// read 4 per lane (one 16 B load) and broadcast within its LPT lanes by shuffles.

#include <torch/extension.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

// Raw CUDA runtime only (no c10/cuda headers): the CPU wheels of torch that CI compile-checks
// against ship none. The caller passes the current stream's handle.
#define TWELL_CUDA_CHECK(expr)                                                        \
  do {                                                                                \
    const cudaError_t err_ = (expr);                                                  \
    TORCH_CHECK(err_ == cudaSuccess, #expr " failed: ", cudaGetErrorString(err_));    \
  } while (0)

namespace {

// The tensors' device current for the launch, the caller's restored after.
struct DeviceScope {
  int prev = -1;
  explicit DeviceScope(int dev) {
    TWELL_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != dev) TWELL_CUDA_CHECK(cudaSetDevice(dev));
  }
  ~DeviceScope() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

constexpr int kThreads = 1024;

template <bool BF16>
__device__ __forceinline__ float lo16(uint32_t v) {
  if constexpr (BF16) return __uint_as_float(v << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xFFFFu)));
}

template <bool BF16>
__device__ __forceinline__ float hi16(uint32_t v) {
  if constexpr (BF16) return __uint_as_float(v & 0xFFFF0000u);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16)));
}

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <bool BF16, int C>
__global__ void __launch_bounds__(kThreads) down_cols_kernel(
    const int32_t* __restrict__ lst, int64_t W, const int32_t* __restrict__ nl,
    const uint16_t* __restrict__ wdt, int64_t swd, const uint16_t* __restrict__ bd,
    uint16_t* __restrict__ y, int64_t sy, int64_t M, int64_t N, int64_t KO, int64_t span,
    bool vec) {
  constexpr int LPT = C / 4;        // lanes per token
  constexpr int TPW = 32 / LPT;     // tokens per warp
  constexpr int EPC = LPT * 4;      // entries per chunk (4 per lane)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* ws = reinterpret_cast<uint16_t*>(smem_raw);   // [N][C]
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * C;

  // 1. the W_down^T slice into shared memory (zero beyond K_out)
  if (vec && c0 + C <= KO) {
    constexpr int PPR = C * 2 / 16;   // 16 B pieces per row
    for (int64_t i = threadIdx.x; i < N * PPR; i += blockDim.x) {
      const int64_t r = i / PPR, p = i % PPR;
      reinterpret_cast<int4*>(ws)[i] = *reinterpret_cast<const int4*>(wdt + r * swd + c0 + p * 8);
    }
  } else {
    for (int64_t i = threadIdx.x; i < N * C; i += blockDim.x) {
      const int64_t r = i / C, c = c0 + i % C;
      ws[i] = c < KO ? wdt[r * swd + c] : uint16_t(0);
    }
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int slot = lane / LPT, q = lane % LPT;
  const unsigned group = static_cast<unsigned>(lane - q);   // first lane of this token's group
  const int64_t col = c0 + q * 4;
  float bias[4] = {0.f, 0.f, 0.f, 0.f};
  if (bd != nullptr) {
    for (int i = 0; i < 4; ++i) {
      if (col + i < KO) bias[i] = BF16 ? __uint_as_float(uint32_t(bd[col + i]) << 16)
                                       : __half2float(__ushort_as_half(bd[col + i]));
    }
  }
  const uint16_t* wq = ws + q * 4;
  const int64_t t_lo = static_cast<int64_t>(blockIdx.y) * span;
  const int64_t t_hi = min(M, t_lo + span);

  // 2. tokens, TPW per warp at a time
  for (int64_t tb = t_lo + static_cast<int64_t>(warp) * TPW; tb < t_hi; tb += static_cast<int64_t>(nwarps) * TPW) {
    const int64_t t = tb + slot;
    const int ne = t < t_hi ? __ldg(nl + t) : -1;
    const int mx = __reduce_max_sync(0xffffffffu, ne);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int32_t* row = lst + (t < t_hi ? t : 0) * W;
    int4 cur = make_int4(0, 0, 0, 0);
    if (q * 4 < ne) cur = __ldg(reinterpret_cast<const int4*>(row + q * 4));
    for (int j0 = 0; j0 < mx; j0 += EPC) {
      int4 nxt = make_int4(0, 0, 0, 0);   // next chunk's entries, one step ahead
      if (j0 + EPC + q * 4 < ne) nxt = __ldg(reinterpret_cast<const int4*>(row + j0 + EPC + q * 4));
#pragma unroll
      for (int k = 0; k < EPC; ++k) {
        const int reg = k & 3;
        const int v = reg == 0 ? cur.x : reg == 1 ? cur.y : reg == 2 ? cur.z : cur.w;
        const uint32_t e = static_cast<uint32_t>(__shfl_sync(0xffffffffu, v, group + k / 4));
        if (j0 + k < ne) {
          const float h = lo16<BF16>(e);
          const uint2 w = *reinterpret_cast<const uint2*>(wq + (e >> 16) * C);
          acc[0] = fmaf(h, lo16<BF16>(w.x), acc[0]);
          acc[1] = fmaf(h, hi16<BF16>(w.x), acc[1]);
          acc[2] = fmaf(h, lo16<BF16>(w.y), acc[2]);
          acc[3] = fmaf(h, hi16<BF16>(w.y), acc[3]);
        }
      }
      cur = nxt;
    }
    if (ne >= 0) {   // -1: the row kernel wrote this row
      uint16_t* yr = y + t * sy + col;
      if (vec && col + 4 <= KO) {
        uint2 o;
        o.x = pack2<BF16>(acc[0] + bias[0], acc[1] + bias[1]);
        o.y = pack2<BF16>(acc[2] + bias[2], acc[3] + bias[3]);
        *reinterpret_cast<uint2*>(yr) = o;
      } else {
        for (int i = 0; i < 4; ++i) {
          if (col + i < KO) {
            const uint32_t b = pack2<BF16>(acc[i] + bias[i], 0.f);
            yr[i] = static_cast<uint16_t>(b & 0xFFFFu);
          }
        }
      }
    }
  }
}

template <bool BF16, int C>
void launch(const torch::Tensor& lst, const torch::Tensor& nl, const torch::Tensor& wdt,
            const c10::optional<torch::Tensor>& bd, torch::Tensor& y, int64_t span, bool vec,
            cudaStream_t stream) {
  const int64_t M = lst.size(0), W = lst.size(1), N = wdt.size(0), KO = wdt.size(1);
  const int64_t smem = N * C * 2;
  auto kern = down_cols_kernel<BF16, C>;
  // the shared-memory limit is raised once per (instantiation, device), not per call (a call
  // may be inside a CUDA-graph capture)
  static int64_t raised[64] = {};
  const int dev = lst.get_device();
  if (dev < 0 || dev >= 64 || raised[dev] < smem) {
    TWELL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    if (dev >= 0 && dev < 64) raised[dev] = smem;
  }
  const dim3 grid(static_cast<unsigned>((KO + C - 1) / C), static_cast<unsigned>((M + span - 1) / span));
  kern<<<grid, kThreads, smem, stream>>>(
      lst.data_ptr<int32_t>(), W, nl.data_ptr<int32_t>(),
      reinterpret_cast<const uint16_t*>(wdt.data_ptr()), wdt.stride(0),
      bd.has_value() ? reinterpret_cast<const uint16_t*>(bd->data_ptr()) : nullptr,
      reinterpret_cast<uint16_t*>(y.data_ptr()), y.stride(0), M, N, KO, span, vec);
  TWELL_CUDA_CHECK(cudaGetLastError());
}

// Checks are the caller's contract (cuda_infer.down_cols checks shapes in Python, once); these
// TORCH_CHECKs guard memory safety only.
void down_cols(const torch::Tensor& lst, const torch::Tensor& nl, const torch::Tensor& wdt,
               const c10::optional<torch::Tensor>& bd, torch::Tensor& y, int64_t cols, int64_t span,
               int64_t stream_handle) {
  TORCH_CHECK(lst.is_cuda() && lst.scalar_type() == torch::kInt32 && lst.dim() == 2 && lst.is_contiguous(),
              "lst: contiguous int32 [M, W] on CUDA");
  TORCH_CHECK(lst.size(1) % 4 == 0, "lst: W must be a multiple of 4");
  TORCH_CHECK(nl.scalar_type() == torch::kInt32 && nl.numel() == lst.size(0) && nl.is_contiguous(), "nl: int32 [M]");
  TORCH_CHECK(wdt.dim() == 2 && wdt.stride(1) == 1, "wdt: [N, K_out] with unit column stride");
  TORCH_CHECK(wdt.scalar_type() == torch::kBFloat16 || wdt.scalar_type() == torch::kHalf, "wdt: bf16 or fp16");
  TORCH_CHECK(y.scalar_type() == wdt.scalar_type() && y.dim() == 2 && y.size(0) == lst.size(0) &&
              y.size(1) == wdt.size(1) && y.stride(1) == 1, "y: [M, K_out] in wdt's dtype, unit column stride");
  TORCH_CHECK(!bd.has_value() || (bd->scalar_type() == wdt.scalar_type() && bd->numel() == wdt.size(1) &&
              bd->is_contiguous()), "bd: [K_out] in wdt's dtype");
  TORCH_CHECK(span > 0, "span must be positive");
  if (lst.size(0) == 0 || wdt.size(1) == 0) return;
  const DeviceScope scope(lst.get_device());
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const bool vec = wdt.size(1) % 8 == 0 && wdt.stride(0) % 8 == 0 && y.stride(0) % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(wdt.data_ptr()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(y.data_ptr()) % 8 == 0;
  const bool bf16 = wdt.scalar_type() == torch::kBFloat16;
#define TWELL_DOWN_CASE(CC)                                          \
  if (cols == CC) {                                                  \
    if (bf16) launch<true, CC>(lst, nl, wdt, bd, y, span, vec, stream);      \
    else launch<false, CC>(lst, nl, wdt, bd, y, span, vec, stream);          \
    return;                                                          \
  }
  TWELL_DOWN_CASE(16)
  TWELL_DOWN_CASE(8)
  TWELL_DOWN_CASE(4)
#undef TWELL_DOWN_CASE
  TORCH_CHECK(false, "cols must be 4, 8 or 16, got ", cols);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("down_cols", &down_cols, "per-row TwELL down projection split by output columns (twell_down.cu)");
}
