// Configuration 2 of twell::gate_pack: 256x128x64 CTA tile, 1x2 cluster, cooperative.
#include "gate_pack.cuh"

namespace twell_gate {
using K2 = GateKernel<256, 128, 64, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
static_assert(K2::kTileN == 128, "gate_pack.cu's kTileN[2]");
const char* run_cfg2(GateArgs const& a) { return run_kernel<K2>(a); }
size_t workspace_cfg2(GateArgs const& a) { return workspace_of<K2>(a); }
}  // namespace twell_gate
