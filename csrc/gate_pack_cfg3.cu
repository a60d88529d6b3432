// Configuration 3 of twell::gate_pack: 64x256x64 tile per consumer warpgroup, 2x1 cluster, ping-pong (one warpgroup's epilogue overlaps the other's mainloop).
#include "gate_pack.cuh"

namespace twell_gate {
using K3 = GateKernel<64, 256, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
static_assert(K3::kTileN == 256, "gate_pack.cu's kTileN[3]");
const char* run_cfg3(GateArgs const& a) { return run_kernel<K3>(a); }
size_t workspace_cfg3(GateArgs const& a) { return workspace_of<K3>(a); }
}  // namespace twell_gate
