// The probe's launch interface (cutlass_gemm.cuh), free of CUTLASS's headers.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace probe {

struct ProbeArgs {
  int m, n, k;
  const void* x;   // [M, K] bf16
  const void* w;   // [N, K] bf16
  void* out;       // [M, N] bf16
  int raster, swizzle, sm_count;
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
};

const char* run0(ProbeArgs const& a);
const char* run1(ProbeArgs const& a);
const char* run2(ProbeArgs const& a);
const char* run3(ProbeArgs const& a);
const char* run4(ProbeArgs const& a);
const char* run5(ProbeArgs const& a);

}  // namespace probe
