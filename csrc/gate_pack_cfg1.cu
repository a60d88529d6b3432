// Configuration 1 of twell::gate_pack: 128x256x64 CTA tile, 1x2 cluster, cooperative.
#include "gate_pack.cuh"

namespace twell_gate {
using K1 = GateKernel<128, 256, 64, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
static_assert(K1::kTileN == 256, "gate_pack.cu's kTileN[1]");
const char* run_cfg1(GateArgs const& a) { return run_kernel<K1>(a); }
size_t workspace_cfg1(GateArgs const& a) { return workspace_of<K1>(a); }
}  // namespace twell_gate
