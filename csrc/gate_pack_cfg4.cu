// Configuration 4 of twell::gate_pack: 128x128x64 tile per consumer warpgroup, 2x1 cluster, ping-pong (one warpgroup's epilogue overlaps the other's mainloop).
#include "gate_pack.cuh"

namespace twell_gate {
using K4 = GateKernel<128, 128, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
static_assert(K4::kTileN == 128, "gate_pack.cu's kTileN[4]");
const char* run_cfg4(GateArgs const& a) { return run_kernel<K4>(a); }
size_t workspace_cfg4(GateArgs const& a) { return workspace_of<K4>(a); }
}  // namespace twell_gate
