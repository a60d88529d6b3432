// The probe at twell::gate_pack's configuration 7 (csrc/gate_pack_cfg7.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run7(ProbeArgs const& a) {
  return run<128, 176, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
             cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::gemm::StreamKScheduler>(a);
}
}  // namespace probe
