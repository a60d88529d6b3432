// Configuration 5 of twell::gate_pack: 128x128x64 tile per consumer warpgroup, 1x2 cluster, ping-pong (one warpgroup's epilogue overlaps the other's mainloop).
#include "gate_pack.cuh"

namespace twell_gate {
using K5 = GateKernel<128, 128, 64, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
static_assert(K5::kTileN == 128, "gate_pack.cu's kTileN[5]");
const char* run_cfg5(GateArgs const& a) { return run_kernel<K5>(a); }
size_t workspace_cfg5(GateArgs const& a) { return workspace_of<K5>(a); }
}  // namespace twell_gate
