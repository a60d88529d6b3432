// The probe at twell::gate_pack's configuration 6 (csrc/gate_pack_cfg6.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run6(ProbeArgs const& a) {
  return run<128, 176, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
             cutlass::epilogue::TmaWarpSpecializedCooperative>(a);
}
}  // namespace probe
