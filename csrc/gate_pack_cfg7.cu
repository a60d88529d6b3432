// Configuration 7 of twell::gate_pack: configuration 6's 128x176x64 cooperative tile with the stream-K scheduler
// (the last wave's tiles split along K over the idle SMs, partial sums fixed up in the workspace).
#include "gate_pack.cuh"

namespace twell_gate {
using K7 = GateKernel<128, 176, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                      cutlass::gemm::StreamKScheduler>;
static_assert(K7::kTileN == 176, "gate_pack.cu's kTileN[7]");
const char* run_cfg7(GateArgs const& a) { return run_kernel<K7>(a); }
size_t workspace_cfg7(GateArgs const& a) { return workspace_of<K7>(a); }
}  // namespace twell_gate
