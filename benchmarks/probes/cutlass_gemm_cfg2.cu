// The probe at twell::gate_pack's configuration 2 (csrc/gate_pack_cfg2.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run2(ProbeArgs const& a) {
  return run<256, 128, 64, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>(a);
}
}  // namespace probe
