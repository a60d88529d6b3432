// The probe at twell::gate_pack's configuration 5 (csrc/gate_pack_cfg5.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run5(ProbeArgs const& a) {
  return run<128, 128, 64, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>(a);
}
}  // namespace probe
