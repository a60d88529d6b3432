// Configuration 6 of twell::gate_pack: 128x176x64 CTA tile, 2x1 cluster, cooperative. N = 5632 is 32 tiles of
// 176 columns: whole waves of 132 SMs at 2048-65536 tokens where 128- and 256-column tiles leave a part wave.
#include "gate_pack.cuh"

namespace twell_gate {
using K6 = GateKernel<128, 176, 64, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
static_assert(K6::kTileN == 176, "gate_pack.cu's kTileN[6]");
const char* run_cfg6(GateArgs const& a) { return run_kernel<K6>(a); }
size_t workspace_cfg6(GateArgs const& a) { return workspace_of<K6>(a); }
}  // namespace twell_gate
