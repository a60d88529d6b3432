// Configuration 0 of twell::gate_pack: 128x256x64 CTA tile, 2x1 cluster, cooperative (two consumer warpgroups share a tile).
#include "gate_pack.cuh"

namespace twell_gate {
using K0 = GateKernel<128, 256, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
static_assert(K0::kTileN == 256, "gate_pack.cu's kTileN[0]");
const char* run_cfg0(GateArgs const& a) { return run_kernel<K0>(a); }
size_t workspace_cfg0(GateArgs const& a) { return workspace_of<K0>(a); }
}  // namespace twell_gate
