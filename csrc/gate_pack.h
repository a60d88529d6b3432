// The launch interface of twell::gate_pack's kernel configurations (gate_pack_cfg*.cu), kept free
// of CUTLASS's headers so that the op's translation unit (gate_pack.cu) compiles without them.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace twell_gate {

// What one call needs (raw pointers; the op in gate_pack.cu checks shapes, dtypes, strides).
struct GateArgs {
  int m, n, k;
  const void* x;        // [M, K] bf16, row-major
  const void* w;        // [N, K] bf16, row-major (nn.Linear weight)
  const void* bias;     // [N] bf16 or nullptr
  void* g;              // [M, ldg] bf16 or nullptr (no dense output)
  int64_t ldg;
  int32_t* packed;      // [M, T, S], or nullptr: no packing (g only)
  int32_t* tcnt;        // [M, T]
  int tiles;            // T = ceil(N / BLK_N)
  int slots;            // S
  int g_spills;         // 1: g written only for row tiles over S slots or holding a non-finite value
  int raster;           // 0 heuristic, 1 along M, 2 along N
  int swizzle;          // 1, 2, 4 or 8
  int sm_count;
  void* workspace;      // get_workspace_size bytes (0 for the persistent scheduler)
  cudaStream_t stream;
};

// Each configuration's entry, defined in its own translation unit (gate_pack_cfg*.cu) so that
// ninja compiles them in parallel. Returns a message on failure, nullptr on success.
const char* run_cfg0(GateArgs const& a);
const char* run_cfg1(GateArgs const& a);
const char* run_cfg2(GateArgs const& a);
const char* run_cfg3(GateArgs const& a);
const char* run_cfg4(GateArgs const& a);
const char* run_cfg5(GateArgs const& a);
size_t workspace_cfg0(GateArgs const& a);
size_t workspace_cfg1(GateArgs const& a);
size_t workspace_cfg2(GateArgs const& a);
size_t workspace_cfg3(GateArgs const& a);
size_t workspace_cfg4(GateArgs const& a);
size_t workspace_cfg5(GateArgs const& a);

}  // namespace twell_gate
