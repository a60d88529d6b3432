// Probe entry: gemm(x, w, out, cfg, raster, swizzle) runs CUTLASS's own GEMM at gate_pack's
// configuration cfg (cutlass_gemm.cuh).
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define PROBE_HAVE_C10_CUDA 1
#endif

#include "cutlass_gemm.h"

namespace {

void gemm(const at::Tensor& x, const at::Tensor& w, at::Tensor out, int64_t cfg, int64_t raster, int64_t swizzle) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16 && x.is_contiguous() && w.is_contiguous() && out.is_contiguous(),
              "probe gemm: contiguous bf16 CUDA tensors");
  TORCH_CHECK(x.size(1) == w.size(1) && out.size(0) == x.size(0) && out.size(1) == w.size(0), "probe gemm: shapes");
  const c10::DeviceGuard guard(x.device());
  probe::ProbeArgs a{};
  a.m = int(x.size(0)); a.n = int(w.size(0)); a.k = int(x.size(1));
  a.x = x.data_ptr(); a.w = w.data_ptr(); a.out = out.data_ptr();
  a.raster = int(raster); a.swizzle = int(swizzle);
  cudaDeviceGetAttribute(&a.sm_count, cudaDevAttrMultiProcessorCount, x.get_device());
  at::Tensor ws = at::empty({1 << 20}, x.options().dtype(at::kByte));
  a.workspace = ws.data_ptr(); a.workspace_bytes = 1 << 20;
#ifdef PROBE_HAVE_C10_CUDA
  a.stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
#else
  a.stream = static_cast<cudaStream_t>(
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(x.device()).native_handle());
#endif
  const char* err = cfg == 0 ? probe::run0(a) : cfg == 1 ? probe::run1(a) : cfg == 2 ? probe::run2(a)
                  : cfg == 3 ? probe::run3(a)
                  : cfg == 4 ? probe::run4(a) : cfg == 5 ? probe::run5(a) : "cfg must be 0..5";
  TORCH_CHECK(err == nullptr, "probe gemm: ", err);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemm", &gemm); }
