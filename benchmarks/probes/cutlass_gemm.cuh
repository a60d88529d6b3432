// Measurement probe: CUTLASS's own sm90 GEMM (TMA warp-specialized mainloop and epilogue, bf16
// out, no packing) at the CTA tiles, clusters and schedules of twell::gate_pack's configurations
// (csrc/gate_pack.cuh), so tune_gate.py --parts can time the mainloop apart from the packing
// epilogue. Not shipped; built by build.load("cutlass_gemm", directory=build.PROBES).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "cutlass_gemm.h"

namespace probe {

template <int BM, int BN, int BK, int CM, int CN, class Schedule, class EpiSchedule>
const char* run(ProbeArgs const& a) {
  using namespace cute;
  using E = cutlass::bfloat16_t;
  using Tile = Shape<Int<BM>, Int<BN>, Int<BK>>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, 8, E, cutlass::layout::RowMajor, 8, EpiSchedule>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, cutlass::layout::RowMajor, 8,
      E, cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {a.m, a.n, a.k, 1};
  args.mainloop.ptr_A = reinterpret_cast<E const*>(a.x);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(a.m, a.k, 1));
  args.mainloop.ptr_B = reinterpret_cast<E const*>(a.w);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(a.n, a.k, 1));
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_D = reinterpret_cast<E*>(a.out);
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(a.m, a.n, 1));
  args.hw_info.sm_count = a.sm_count;
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = a.raster == 1 ? Raster::AlongM : a.raster == 2 ? Raster::AlongN : Raster::Heuristic;
  args.scheduler.max_swizzle_size = a.swizzle;
  Gemm gemm;
  if (Gemm::get_workspace_size(args) > a.workspace_bytes) return "workspace too small";
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "cannot implement";
  if (gemm.initialize(args, a.workspace, a.stream) != cutlass::Status::kSuccess) return "initialize failed";
  if (gemm.run(a.stream) != cutlass::Status::kSuccess) return "launch failed";
  return nullptr;
}

}  // namespace probe
