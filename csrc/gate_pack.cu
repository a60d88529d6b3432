// The CUDA kernels of twell::gate_pack (schema and fake: twell_compile/ops.py): argument checks and
// the dispatch to one of the kernel configurations (gate_pack.h).
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>
// A CPU build of torch ships no c10/cuda configuration header: there (CI's compile check) the
// current stream comes through the device-generic Stream API instead.
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define TWELL_HAVE_C10_CUDA 1
#endif

#include "gate_pack.h"

namespace {

using twell_gate::GateArgs;

// Columns per TwELL tile of each configuration (its CTA tile's N).
constexpr int kTileN[] = {256, 256, 128, 256, 128, 128};
constexpr int kConfigs = 6;

const char* run_config(int64_t cfg, GateArgs const& a) {
  switch (cfg) {
    case 0: return twell_gate::run_cfg0(a);
    case 1: return twell_gate::run_cfg1(a);
    case 2: return twell_gate::run_cfg2(a);
    case 3: return twell_gate::run_cfg3(a);
    case 4: return twell_gate::run_cfg4(a);
    case 5: return twell_gate::run_cfg5(a);
  }
  return "unknown configuration";
}

size_t workspace_config(int64_t cfg, GateArgs const& a) {
  switch (cfg) {
    case 0: return twell_gate::workspace_cfg0(a);
    case 1: return twell_gate::workspace_cfg1(a);
    case 2: return twell_gate::workspace_cfg2(a);
    case 3: return twell_gate::workspace_cfg3(a);
    case 4: return twell_gate::workspace_cfg4(a);
    case 5: return twell_gate::workspace_cfg5(a);
  }
  return 0;
}

// The device's SM count, asked once per device (the persistent scheduler launches one CTA per SM).
int sm_count(int device) {
  static int counts[64] = {0};
  int got = device >= 0 && device < 64 ? counts[device] : 0;
  if (got == 0) {
    const cudaError_t err = cudaDeviceGetAttribute(&got, cudaDevAttrMultiProcessorCount, device);
    TORCH_CHECK(err == cudaSuccess, "twell::gate_pack: cudaDeviceGetAttribute: ", cudaGetErrorString(err));
    if (device >= 0 && device < 64) counts[device] = got;
  }
  return got;
}

void gate_pack(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor g,
               at::Tensor packed, at::Tensor tcnt, int64_t cfg, int64_t raster, int64_t swizzle, bool g_spills) {
  TORCH_CHECK(cfg >= 0 && cfg < kConfigs, "twell::gate_pack: cfg must be in [0, ", kConfigs, "), got ", cfg);
  TORCH_CHECK(x.is_cuda() && w.is_cuda(), "twell::gate_pack: x and w must be CUDA tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "twell::gate_pack: x and w must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "twell::gate_pack: x [M, K], w [N, K]");
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) == x.size(1) && w.is_contiguous(),
              "twell::gate_pack: x and w must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % 8 == 0 && n % 8 == 0 && k > 0 && n > 0, "twell::gate_pack: K and N must be positive multiples of 8");
  TORCH_CHECK(n <= 65536, "twell::gate_pack: the packed columns take 16 bits, N <= 65536");
  TORCH_CHECK(m < (int64_t(1) << 31), "twell::gate_pack: M must fit 31 bits");
  const int64_t tiles = (n + kTileN[cfg] - 1) / kTileN[cfg];
  // an empty packed (and tcnt): g alone, no packing, for timing the parts apart (tune_gate.py)
  const bool pack = packed.numel() > 0;
  TORCH_CHECK(pack || g.numel() > 0, "twell::gate_pack: g and packed are both empty: nothing to write");
  if (pack) {
    TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 3 && packed.size(0) == m &&
                    packed.size(1) == tiles && packed.size(2) > 0 && packed.is_contiguous(),
                "twell::gate_pack: packed must be contiguous int32 [M, ", tiles, ", S]");
    TORCH_CHECK(tcnt.scalar_type() == at::kInt && tcnt.dim() == 2 && tcnt.size(0) == m && tcnt.size(1) == tiles &&
                    tcnt.is_contiguous(),
                "twell::gate_pack: tcnt must be contiguous int32 [M, ", tiles, "]");
  }
  const bool dense = g.numel() > 0;
  if (dense) {
    TORCH_CHECK(g.scalar_type() == at::kBFloat16 && g.dim() == 2 && g.size(0) == m && g.size(1) == n &&
                    g.stride(1) == 1 && g.stride(0) % 2 == 0,
                "twell::gate_pack: g must be bfloat16 [M, N] with unit column stride and an even row stride");
  }
  TORCH_CHECK(!g_spills || (pack && dense),
              "twell::gate_pack: g_spills writes g where the packing spills: it needs both g and packed");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous(), "twell::gate_pack: bias must be contiguous bfloat16 [N]");
  }
  if (m == 0) return;
  const c10::DeviceGuard guard(x.device());
  GateArgs a{};
  a.m = int(m); a.n = int(n); a.k = int(k);
  a.x = x.data_ptr(); a.w = w.data_ptr(); a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.g = dense ? g.data_ptr() : nullptr; a.ldg = dense ? g.stride(0) : 0;
  a.packed = pack ? packed.data_ptr<int32_t>() : nullptr; a.tcnt = pack ? tcnt.data_ptr<int32_t>() : nullptr;
  a.tiles = int(tiles); a.slots = pack ? int(packed.size(2)) : 0; a.g_spills = g_spills ? 1 : 0;
  a.raster = int(raster); a.swizzle = int(swizzle);
  a.sm_count = sm_count(x.get_device());
#ifdef TWELL_HAVE_C10_CUDA
  a.stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
#else
  a.stream = static_cast<cudaStream_t>(
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(x.device()).native_handle());
#endif
  at::Tensor ws;
  const size_t ws_bytes = workspace_config(cfg, a);
  if (ws_bytes > 0) {
    ws = at::empty({int64_t(ws_bytes)}, x.options().dtype(at::kByte));
    a.workspace = ws.data_ptr();
  }
  const char* err = run_config(cfg, a);
  TORCH_CHECK(err == nullptr, "twell::gate_pack: ", err);
}

}  // namespace

TORCH_LIBRARY_IMPL(twell, CUDA, m) { m.impl("gate_pack", &gate_pack); }

// The columns per TwELL tile of each configuration, for the Python side's buffers.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tile_n", [](int64_t cfg) {
    TORCH_CHECK(cfg >= 0 && cfg < kConfigs, "cfg must be in [0, ", kConfigs, ")");
    return kTileN[cfg];
  });
  m.def("configs", []() { return kConfigs; });
}
