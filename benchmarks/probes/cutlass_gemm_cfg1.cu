// The probe at twell::gate_pack's configuration 1 (csrc/gate_pack_cfg1.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run1(ProbeArgs const& a) {
  return run<128, 256, 64, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>(a);
}
}  // namespace probe
