// The probe at twell::gate_pack's configuration 4 (csrc/gate_pack_cfg4.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run4(ProbeArgs const& a) {
  return run<128, 128, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>(a);
}
}  // namespace probe
