// The probe at twell::gate_pack's configuration 3 (csrc/gate_pack_cfg3.cu), CUTLASS's own epilogue.
#include "cutlass_gemm.cuh"

namespace probe {
const char* run3(ProbeArgs const& a) {
  return run<64, 256, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>(a);
}
}  // namespace probe
