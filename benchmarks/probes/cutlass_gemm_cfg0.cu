// The probe at twell::gate_pack's configuration 0 (csrc/gate_pack_cfg0.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run0(ProbeArgs const& a) {
  return run<128, 256, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>(a);
}
}  // namespace probe
