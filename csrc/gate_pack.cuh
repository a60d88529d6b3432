// The gate GEMM g = x W_g^T (+ b_g) with the TwELL packing in its epilogue (sm90a, CUTLASS 3.x).
//
// Mainloop: CUTLASS's TMA warp-specialized collective (a producer warp loads A/B tiles through a
// shared-memory pipeline; consumer warpgroups run wgmma). Epilogue (TwellPackEpilogue): straight
// from the accumulator registers, per CTA tile of BLK_N columns (one TwELL tile):
//   g          the rounded pre-activation, written dense (the exact tail of the row kernels reads
//              it for rows whose lists overflow), or with g_spills only where a row's tile holds
//              more non-zeros than its S slots or a non-finite value (merge_tiles_kernel rebuilds
//              the rest of the rows that need it from the slots);
//   tcnt[m,t]  the non-zeros of relu(g) in row m, tile t (NaN counted, as eager propagates it);
//   packed[m,t,s]  its first S non-zeros in column order, (column << 16) | bits(value).
// A wgmma accumulator row is held by the four lanes of a quad, lane q holding columns 8j + 2q and
// 8j + 2q + 1; each lane builds a 2-bit-per-group mask of its non-zeros and the quad exchanges
// masks (4 or 8 shuffles, only where the warp holds a non-zero), so every non-zero's rank in
// column order is a few popcounts: the slots are in column order, deterministic, with no
// shared-memory atomics.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "gate_pack.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace twell_gate {

struct PackArgs {
  cutlass::bfloat16_t* g;
  int64_t ldg;
  const cutlass::bfloat16_t* bias;
  int32_t* packed;
  int32_t* tcnt;
  int tiles;
  int slots;
  int g_spills;   // g written only for row tiles over their slots or holding a non-finite value
};

// bf16x2 of (lo, hi), rounded to nearest even: the low half holds lo (the left column).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
  return v;
}

// 0xffff in each half of v (bf16x2) where relu keeps it non-zero: > 0, or NaN (unordered).
__device__ __forceinline__ uint32_t relu_nonzero_halves(uint32_t v) {
  uint32_t m;
  asm("set.gtu.u32.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(v), "r"(0u));
  return m;
}

// 0xffff in each half of v (bf16x2) that is +-Inf or NaN: |v| >= Inf, or unordered.
__device__ __forceinline__ uint32_t nonfinite_halves(uint32_t v) {
  uint32_t m;
  asm("set.geu.u32.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(v & 0x7fff7fffu), "r"(0x7f807f80u));
  return m;
}

// A row mask's bits of pair i: bit i (its left column) and bit P + i (its right one).
template <class Mask, int P>
__device__ __forceinline__ constexpr Mask pair_bits(int i) {
  return (Mask(1) << i) | (Mask(1) << (P + i));
}

// A row mask's bits of the pairs before pair i, both columns.
template <class Mask, int P>
__device__ __forceinline__ constexpr Mask before_bits(int i) {
  return ((Mask(1) << i) - 1) | (((Mask(1) << i) - 1) << P);
}

// The two 0/0xffff halves of m placed where a P-pair mask keeps them: bit 0 of the low half at
// every bit below P, the high half's at every bit from P (ANDed with pair_bits(i) afterwards).
template <class Mask, int P>
__device__ __forceinline__ Mask spread_halves(uint32_t m) {
  if constexpr (P == 16) {
    return Mask(m);   // 0xffff halves: bits 0-15 and 16-31 already
  } else {
    const Mask lo = (m & 0xffffu) ? ~Mask(0) >> (8 * sizeof(Mask) - P) : Mask(0);
    const Mask hi = (m >> 16) ? (~Mask(0) >> (8 * sizeof(Mask) - P)) << P : Mask(0);
    return lo | hi;
  }
}

// An sm70-style epilogue (the interface of cutlass::epilogue::collective::DefaultEpilogue), made a
// warp-specialized sm90 epilogue by Sm90TmaWarpSpecializedAdapter: no shared memory, so every byte
// of it goes to the mainloop's stages.
struct TwellPackEpilogue {
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementOutput = cutlass::bfloat16_t;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  // named by GemmUniversalAdapter (its EpilogueOutputOp); never called here
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  using Arguments = PackArgs;
  using Params = PackArgs;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.packed == nullptr || (args.tcnt != nullptr && args.slots > 0);
  }

  CUTLASS_HOST_DEVICE TwellPackEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    // ((2 columns, 2 rows, NG groups of 8 columns), MMA_M, MMA_N): the wgmma accumulator layout
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "unexpected accumulator layout");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "unexpected accumulator layout");
    constexpr int NG = size<0, 2>(FrgLayout{});
    constexpr int MM = size<1>(FrgLayout{});
    constexpr int MN = size<2>(FrgLayout{});
    constexpr int P = NG * MN;              // this lane's column pairs in a row
    static_assert(P <= 32, "one lane's pairs of a row must fit a 64-bit mask");
    using Mask = cute::conditional_t<(P <= 16), uint32_t, uint64_t>;

    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const int m_coord = get<0>(blk_coord_mnkl);
    const int n_coord = get<1>(blk_coord_mnkl);
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    Tensor tCcD = thr_mma.partition_C(cD);   // (m, n) of each accumulator

    const int lane = threadIdx.x & 31;
    const int q = lane & 3;
    const int quad0 = lane & ~3;
    const int tile = n_coord;
    const int S = params.slots;
    const bool pack = params.packed != nullptr;
    auto* g = reinterpret_cast<__nv_bfloat16*>(params.g);
    const bool spills = params.g_spills != 0 && g != nullptr && pack;
    // every column of this CTA tile in range: no per-pair column test (N % 8 == 0, so a pair
    // is in range whole or not at all)
    const bool full_n = (n_coord + 1) * int(size<1>(blk_shape_MNK)) <= N;

    // fn(i, col, a0, a1) for each of this lane's pairs in row (r, mm), in column order: its index
    // i (unrolled: a compile-time register index), its left column and its two accumulators
    auto each_pair = [&](int r, int mm, auto&& fn) {
      CUTLASS_PRAGMA_UNROLL
      for (int mn = 0; mn < MN; ++mn) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < NG; ++j) {
          fn(mn * NG + j, int(get<1>(tCcD(make_coord(make_coord(0, r, j), mm, mn)))),
             acc(make_coord(make_coord(0, r, j), mm, mn)), acc(make_coord(make_coord(1, r, j), mm, mn)));
        }
      }
    };

    // the bias of this lane's pairs: loaded once per tile into registers (the same for every
    // row) where they fit beside the accumulators (P <= 16), else per pair from L1
    constexpr bool kHoist = P <= 16;
    const auto* bias_ptr = reinterpret_cast<const __nv_bfloat162*>(params.bias);
    float2 hoisted[kHoist ? P : 1];
    auto load_bias = [&](int col) {
      if (bias_ptr == nullptr || col >= N) return make_float2(0.f, 0.f);
      const __nv_bfloat162 b = bias_ptr[col / 2];
      return make_float2(__bfloat162float(b.x), __bfloat162float(b.y));
    };
    if constexpr (kHoist) {
      each_pair(0, 0, [&](int i, int col, float, float) { hoisted[i] = load_bias(col); });
    }
    auto bias_of = [&](int i, int col) {
      if constexpr (kHoist) return hoisted[i];
      else return load_bias(col);
    };

    // Columns of this lane's pairs (the same for every row) and which are inside N: bit i and
    // bit P + i for pair i (its two columns), as the row masks below hold them.
    Mask in_n = 0;
    each_pair(0, 0, [&](int i, int col, float, float) {
      if (full_n || col < N) in_n |= pair_bits<Mask, P>(i);
    });

    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < MM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = get<0>(tCcD(make_coord(make_coord(0, r, 0), mm, 0)));
        const bool row_ok = row < M;
        // 1. bias and rounding to bf16x2 (vals[i]: pair i, low half the left column), and this
        //    lane's mask: bit i for the left column of pair i, bit P + i for the right one. A
        //    half is a non-zero of relu where it is > 0 or NaN: one unordered bf16x2 compare
        //    gives 0xffff per such half, and one AND with the pair's two bits files both.
        uint32_t vals[P];
        Mask mask = 0;
        uint32_t nonfinite = 0;
        each_pair(r, mm, [&](int i, int col, float a0, float a1) {
          const float2 b = bias_of(i, col);
          vals[i] = pack_bf16x2(a0 + b.x, a1 + b.y);
          mask |= spread_halves<Mask, P>(relu_nonzero_halves(vals[i])) & pair_bits<Mask, P>(i);
          if (spills) nonfinite |= nonfinite_halves(vals[i]);
        });
        mask = row_ok ? mask & in_n : Mask(0);
        // 2. the dense store of g (the exact paths read it): unpredicated where the tile holds
        //    every column of its pairs; with g_spills, after the count (step 3), only where the
        //    row's tile needs it
        auto store_g = [&]() {
          __nv_bfloat16* grow = g + int64_t(row) * params.ldg;
          auto store = [&](auto all_cols) {
            each_pair(r, mm, [&](int i, int col, float, float) {
              if (decltype(all_cols)::value || (in_n & pair_bits<Mask, P>(i))) {
                *reinterpret_cast<uint32_t*>(grow + col) = vals[i];
              }
            });
          };
          if (full_n) store(cute::true_type{});
          else store(cute::false_type{});
        };
        if (g != nullptr && row_ok && !spills) store_g();
        if (!pack) continue;   // g only (tune_gate.py times the parts apart)
        // 3. the row's count in this tile: the quad's masks' popcounts. Lanes whose quad holds
        //    no non-zero (most, at low density) and no non-finite value write 0 and are done.
        const bool any = __any_sync(0xffffffffu, mask != 0 || nonfinite != 0);
        if (!any) {
          if (q == 0 && row_ok) params.tcnt[int64_t(row) * params.tiles + tile] = 0;
          continue;
        }
        Mask qm[4];
        CUTLASS_PRAGMA_UNROLL
        for (int o = 0; o < 4; ++o) {
          if constexpr (sizeof(Mask) == 4) {
            qm[o] = __shfl_sync(0xffffffffu, mask, quad0 + o);
          } else {
            const unsigned lo = __shfl_sync(0xffffffffu, unsigned(mask), quad0 + o);
            const unsigned hi = __shfl_sync(0xffffffffu, unsigned(uint64_t(mask) >> 32), quad0 + o);
            qm[o] = (uint64_t(hi) << 32) | lo;
          }
        }
        // the quad's non-finite flag (g_spills): every lane of the warp takes part
        unsigned quad_nonfinite = 0;
        if (spills) {
          quad_nonfinite = nonfinite != 0;
          quad_nonfinite |= __shfl_xor_sync(0xffffffffu, quad_nonfinite, 1);
          quad_nonfinite |= __shfl_xor_sync(0xffffffffu, quad_nonfinite, 2);
        }
        if (!row_ok) continue;   // uniform per quad
        auto popc = [](Mask m) { return sizeof(Mask) == 4 ? __popc(uint32_t(m)) : __popcll(uint64_t(m)); };
        const int count = popc(qm[0]) + popc(qm[1]) + popc(qm[2]) + popc(qm[3]);
        if (q == 0) params.tcnt[int64_t(row) * params.tiles + tile] = count;
        if (spills && (count > S || quad_nonfinite)) store_g();
        if (mask == 0) continue;
        // 4. each non-zero's rank in column order: the quad's non-zeros in earlier pairs (its
        //    lanes' masks below pair i), then those of the lanes before this one in pair i, then
        //    this lane's left column where the right one is being filed
        int32_t* dst = params.packed + (int64_t(row) * params.tiles + tile) * S;
        each_pair(r, mm, [&](int i, int col, float, float) {
          const Mask here = pair_bits<Mask, P>(i);
          if (mask & here) {
            const Mask lower = before_bits<Mask, P>(i);
            int rank = popc(qm[0] & lower) + popc(qm[1] & lower) + popc(qm[2] & lower) + popc(qm[3] & lower);
            CUTLASS_PRAGMA_UNROLL
            for (int o = 0; o < 3; ++o) {
              if (o < q) rank += popc(qm[o] & here);
            }
            const Mask left = Mask(1) << i;
            if (mask & left) {
              if (rank < S) dst[rank] = (col << 16) | int32_t(vals[i] & 0xffffu);
              ++rank;
            }
            if ((mask & (left << P)) && rank < S) {
              dst[rank] = ((col + 1) << 16) | int32_t(vals[i] >> 16);
            }
          }
        });
      }
    }
  }

  Params params;
};

// One kernel configuration: CTA tile, cluster, mainloop schedule.
template <int BM, int BN, int BK, int CM, int CN, class Schedule>
struct GateKernel {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<BM>, cute::Int<BN>, cute::Int<BK>>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<TwellPackEpilogue>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, 8,       // A = x [M, K]
      Element, cutlass::layout::ColumnMajor, 8,    // B = W_g^T: W_g [N, K] row-major
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<0>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kTileN = BN;

  static typename Gemm::Arguments arguments(GateArgs const& a) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {a.m, a.n, a.k, 1};
    args.mainloop.ptr_A = reinterpret_cast<Element const*>(a.x);
    args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(a.m, a.k, 1));
    args.mainloop.ptr_B = reinterpret_cast<Element const*>(a.w);
    args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(a.n, a.k, 1));
    args.epilogue = PackArgs{reinterpret_cast<Element*>(a.g), a.ldg, reinterpret_cast<Element const*>(a.bias),
                             a.packed, a.tcnt, a.tiles, a.slots, a.g_spills};
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = a.sm_count;
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = a.raster == 1 ? Raster::AlongM : a.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    args.scheduler.max_swizzle_size = a.swizzle;
    return args;
  }
};

template <class K>
size_t workspace_of(GateArgs const& a) {
  return K::Gemm::get_workspace_size(K::arguments(a));
}

template <class K>
const char* run_kernel(GateArgs const& a) {
  typename K::Gemm gemm;
  auto args = K::arguments(a);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "the CUTLASS kernel cannot run this problem";
  if (gemm.initialize(args, a.workspace, a.stream) != cutlass::Status::kSuccess) return "CUTLASS initialize failed";
  if (gemm.run(a.stream) != cutlass::Status::kSuccess) return "CUTLASS launch failed";
  return nullptr;
}

}  // namespace twell_gate
