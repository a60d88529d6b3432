// CPU inference FFN: y = down(relu(gate(x)) [* up(x)]), sparse in the hidden dimension; squared
// ReLU and dReLU (act) share relu(gate(x))'s zero pattern and differ only where h is formed.
//
//   1. gate GEMM through ATen (MKL / oneDNN), then one pass per row: ReLU in place (NaN kept, as
//      torch.relu keeps it), count non-zeros.
//   2. density = nnz / (M N) > max_density: the dense up/down in ATen inside this call (the
//      same calls eager PyTorch makes). The rule is a plain branch on the count computed here.
//   3. otherwise pack each row's active columns (CSR) and, per block of tokens, sort the block's
//      pairs by neuron, then
//        A: h[p] = g[p] * (x[m] . W_up[n] + b_up[n])   parallel over the block's active neurons
//        B: y[m, k0:k1] += h[p] * W_down[k0:k1, n]       parallel over output column chunks
//      reading only active rows of W_up and active columns of W_down, in the weights' own
//      layouts (no derived copy that could go stale): each thread packs its chunk's active
//      columns of W_down (a forward sweep over each row of the chunk, columns ascending) into
//      a buffer [active, k1 - k0], then runs the axpys from it. A W_down that is a transposed
//      view (column stride 1) is read in place.
//   Non-finite values (the contract of every path, docs/cpu.md "NaN and Inf"): a gated row whose
//   x holds NaN/Inf goes dense, where dense PyTorch makes 0 * Inf = NaN at inactive neurons, and
//   so do we; an inactive neuron of a finite row contributes exactly 0, whatever its weights hold.
//
// Accumulation is fp32 for fp32 and bf16 inputs (bf16 rounds once, at the output).
// SIMD: GCC/Clang vector extensions (16 lanes; the compiler splits them to AVX2/SSE where AVX-512
// is absent). Threads: OpenMP, the same runtime as ATen's, so torch.set_num_threads applies.

#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int64_t kLanes = 16;
// Parallel regions only above this many element operations (~1 ms of work on one core): on a
// loaded machine each region can wait a scheduler slice (~5 ms measured on the shared 2-core VM:
// M = 16, d = 0.005 took 44 ms with 2 threads vs 15 ms with 1) for a descheduled thread.
constexpr int64_t kGrain = int64_t(1) << 22;
// Phase B's work in element operations: each W_down element it packs is read from a column, a
// row (a page at N = 5632 fp32) apart, and costs about a cache line's worth of streamed
// elements: counted as 8, its region opens at M = 16, d = 0.005 (14.5 ms against 17.7 counted as
// 1, on one thread; results/cpu-amd-epyc/kernel_probe.json, benchmarks/probes/cpu_kernel_probe.py).
#ifndef TWELL_PHASE_B_LINE_COST
#define TWELL_PHASE_B_LINE_COST 8
#endif
constexpr int64_t kLineCost = TWELL_PHASE_B_LINE_COST;

inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) { return static_cast<float>(v); }

inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16*>(p); }
inline f32x16 load16(const c10::BFloat16* p) {
  u16x16 raw = *reinterpret_cast<const u16x16*>(p);
  u32x16 wide = __builtin_convertvector(raw, u32x16) << 16;
  f32x16 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline float hsum(f32x16 v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// x . w over K, fp32 accumulation in 4 independent vectors (hides the 4-cycle FMA latency).
template <typename T>
inline float dot(const T* x, const T* w, int64_t k) {
  f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 4 * kLanes <= k; i += 4 * kLanes) {
    a0 += load16(x + i) * load16(w + i);
    a1 += load16(x + i + kLanes) * load16(w + i + kLanes);
    a2 += load16(x + i + 2 * kLanes) * load16(w + i + 2 * kLanes);
    a3 += load16(x + i + 3 * kLanes) * load16(w + i + 3 * kLanes);
  }
  for (; i + kLanes <= k; i += kLanes) a0 += load16(x + i) * load16(w + i);
  float s = hsum((a0 + a1) + (a2 + a3));
  for (; i < k; ++i) s += to_f32(x[i]) * to_f32(w[i]);
  return s;
}

// y[0:k] += h * w[0:k] (a row chunk of W_down^T, fp32 accumulation).
template <typename T>
inline void axpy(float* y, float h, const T* w, int64_t k) {
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    f32x16 acc = load16(y + i) + h * load16(w + i);
    std::memcpy(y + i, &acc, sizeof(acc));
  }
  for (; i < k; ++i) y[i] += h * to_f32(w[i]);
}

// Software prefetch of a weight row about to be read: rows are 4-8 KB, two pages, and the
// hardware streamer stops at page ends; without this the pair loop waits on DRAM latency.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Activations (the act argument; twell_compile/reference.py): h = a(relu(g)) [* b(u)] with
// a = relu(g)^2 for relu2 (rounded to the dtype, as eager's square), b = relu(u) for drelu.
constexpr int64_t kRelu = 0, kRelu2 = 1, kDRelu = 2;

// b(u) of a dense up projection (the dense calls and the non-finite rows).
inline at::Tensor up_act(at::Tensor u, int64_t act) { return act == kDRelu ? u.relu_() : u; }

// ReLU in place keeping NaN (as torch.relu); returns the row's non-zeros (NaN counts as one).
template <typename T>
inline int32_t relu_count(T* g, int64_t n) {
  int32_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(g[i]);
    const bool live = !(v <= 0.f);  // v > 0 or NaN
    if (!live) g[i] = T(0.f);
    c += live;
  }
  return c;
}

// Whether every x[0:k] is finite (x * 0 is 0 for finite x, NaN for NaN and Inf).
template <typename T>
bool row_finite(const T* x, int64_t k) {
  f32x16 acc = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) acc += load16(x + i) * 0.f;
  float s = hsum(acc);
  for (; i < k; ++i) s += to_f32(x[i]) * 0.f;
  return s == 0.f;
}

// Pass 1, per row: ReLU + count; flag gated rows whose x holds NaN/Inf (they go dense).
template <typename T>
void relu_pass(const at::Tensor& x2, at::Tensor& hg, bool gated, int32_t* cnt, int32_t* work,
               uint8_t* dense_row) {
  const int64_t m = x2.size(0), k = x2.size(1), n = hg.size(1);
  T* gp = hg.data_ptr<T>();
  const T* xp = x2.data_ptr<T>();
#pragma omp parallel for schedule(static) if (m * (n + k) >= kGrain && m > 1)
  for (int64_t r = 0; r < m; ++r) {
    cnt[r] = relu_count(gp + r * n, n);
    dense_row[r] = gated && !row_finite(xp + r * k, k);
    work[r] = dense_row[r] ? 0 : cnt[r];
  }
}

// Sparse up/down over blocks of `block` tokens. Inside a block the active pairs are sorted by
// neuron, so each active row of W_up / W_down^T is read from memory once per block and reused by
// every token of the block that needs it (x and y rows of the block stay in L2: 64 tokens x 16 KB
// = 1 MB at K = 2048 fp32). Token-major order would re-read a weight row per pair: 4x to 10x
// more DRAM traffic at M >= 256 (measured, docs/cpu.md).
template <typename T>
void sparse_up_down(const at::Tensor& x2, const at::Tensor& hg, const int32_t* work,
                    const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                    const at::Tensor& w_down, float* yacc, float* abs_sum_out, int64_t block, int64_t act) {
  const int64_t m = x2.size(0), k = x2.size(1), n = hg.size(1), kout = w_down.size(0);
  const T* xp = x2.data_ptr<T>();
  const T* gp = hg.data_ptr<T>();
  const T* wdp = w_down.data_ptr<T>();
  const int64_t wd_row = w_down.stride(0), wd_col = w_down.stride(1);
  const bool wd_in_place = wd_row == 1;  // a transposed view: W_down^T rows are contiguous
  const T* wup = w_up.has_value() ? w_up->data_ptr<T>() : nullptr;
  const int64_t ld_up = w_up.has_value() ? w_up->stride(0) : 0;
  const T* bup = b_up.has_value() ? b_up->data_ptr<T>() : nullptr;

  // CSR of the active (row, column) pairs, rows ascending, columns ascending within a row.
  std::vector<int64_t> off(m + 1, 0);
  for (int64_t r = 0; r < m; ++r) off[r + 1] = off[r] + work[r];
  const int64_t pairs = off[m];
  std::vector<int32_t> row_of(pairs), col(pairs);
  std::vector<float> h(pairs);
#pragma omp parallel for schedule(dynamic, 16) if (m * n >= kGrain && m > 1)
  for (int64_t r = 0; r < m; ++r) {
    int64_t p = off[r];
    if (p == off[r + 1]) continue;
    const T* g = gp + r * n;
    for (int64_t c = 0; c < n; ++c) {
      const float v = to_f32(g[c]);
      if (v != 0.f || v != v) {
        row_of[p] = static_cast<int32_t>(r);
        col[p] = static_cast<int32_t>(c);
        h[p] = act == kRelu2 ? to_f32(T(v * v)) : v;  // the square rounded as eager's
        ++p;
      }
    }
  }

  // Down-projection column chunks: >= 256 columns (1 KB fp32), 2 per thread for balance.
  const int64_t threads = omp_get_max_threads();
  int64_t chunks = std::min<int64_t>(2 * threads, std::max<int64_t>(1, kout / 256));
  if (threads == 1) chunks = 1;
  const int64_t width = ((kout + chunks - 1) / chunks + kLanes - 1) / kLanes * kLanes;
  chunks = (kout + width - 1) / width;

  std::vector<int32_t> start(n + 1), order, ucols;
  double abs_total = 0.0;
  for (int64_t b0 = 0; b0 < m; b0 += block) {
    const int64_t b1 = std::min(m, b0 + block), p0 = off[b0], np = off[b1] - p0;
    if (np == 0) continue;
    // Counting sort of the block's pairs by column (stable: tokens stay ascending per column).
    std::fill(start.begin(), start.end(), 0);
    for (int64_t p = p0; p < p0 + np; ++p) ++start[col[p] + 1];
    ucols.clear();
    for (int64_t c = 0; c < n; ++c) {
      if (start[c + 1]) ucols.push_back(static_cast<int32_t>(c));
      start[c + 1] += start[c];
    }
    order.resize(np);
    {
      std::vector<int32_t> fill(start.begin(), start.end() - 1);
      for (int64_t p = p0; p < p0 + np; ++p) order[fill[col[p]]++] = static_cast<int32_t>(p);
    }
    const int64_t nu = static_cast<int64_t>(ucols.size());

    // A: h[p] = g[p] * (x[row] . W_up[col] + b_up[col]).
    if (wup) {
#pragma omp parallel for schedule(dynamic, 4) if (np * k >= kGrain && nu > 1)
      for (int64_t i = 0; i < nu; ++i) {
        const int64_t c = ucols[i];
        if (i + 1 < nu) prefetch_bytes(wup + static_cast<int64_t>(ucols[i + 1]) * ld_up, k * sizeof(T));
        const T* w = wup + c * ld_up;
        const float bias = bup ? to_f32(bup[c]) : 0.f;
        for (int64_t q = start[c]; q < start[c + 1]; ++q) {
          const int64_t p = order[q];
          const float u = dot(xp + static_cast<int64_t>(row_of[p]) * k, w, k) + bias;
          h[p] *= act == kDRelu ? (u < 0.f ? 0.f : u) : u;  // dReLU: relu(u), NaN kept
        }
      }
    }
    if (abs_sum_out) {
      for (int64_t p = p0; p < p0 + np; ++p) abs_total += std::fabs(static_cast<double>(h[p]));
    }

    // B: y[row, k0:k1] += h[p] * W_down[k0:k1, col]; each thread owns a column chunk.
#pragma omp parallel for schedule(dynamic, 1) if (np * kout * kLineCost >= kGrain && chunks > 1)
    for (int64_t t = 0; t < chunks; ++t) {
      const int64_t k0 = t * width, kw = std::min(width, kout - k0);
      std::unique_ptr<T[]> packed;  // uninitialised: every element is written below
      if (!wd_in_place) {
        // The chunk's active columns, [nu, kw], written contiguously; the kw rows' cache lines
        // (kw x 64 B: 16 KB at kw = 256) stay in L1 while consecutive columns reuse them.
        packed.reset(new T[static_cast<size_t>(nu * kw)]);
        const T* base = wdp + k0 * wd_row;
        for (int64_t i = 0; i < nu; ++i) {
          const T* col = base + static_cast<int64_t>(ucols[i]) * wd_col;
          T* dst = packed.get() + i * kw;
          for (int64_t kk = 0; kk < kw; ++kk) dst[kk] = col[kk * wd_row];
        }
      }
      for (int64_t i = 0; i < nu; ++i) {
        const int64_t c = ucols[i];
        const T* w = wd_in_place ? wdp + c * wd_col + k0 : packed.get() + i * kw;
        if (wd_in_place && i + 1 < nu)
          prefetch_bytes(wdp + static_cast<int64_t>(ucols[i + 1]) * wd_col + k0, kw * sizeof(T));
        for (int64_t q = start[c]; q < start[c + 1]; ++q) {
          const int64_t p = order[q];
          axpy(yacc + static_cast<int64_t>(row_of[p]) * kout + k0, h[p], w, kw);
        }
      }
    }
  }
  if (abs_sum_out) *abs_sum_out += static_cast<float>(abs_total);
}

}  // namespace

// x2 [M, K] contiguous; w_gate [N, K]; w_up [N, K] with unit column stride (or None);
// w_down [K_out, N], any strides (read in place); block: tokens per block of the sparse part;
// max_density: above it the call runs dense.
// Returns (y [M, K_out], counts [M] int32, abs_sum [] fp32, dense [] bool).
std::vector<at::Tensor> ffn_forward(const at::Tensor& x2, const at::Tensor& w_gate,
                                    const c10::optional<at::Tensor>& b_gate,
                                    const c10::optional<at::Tensor>& w_up,
                                    const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down,
                                    const c10::optional<at::Tensor>& b_down,
                                    double max_density, bool want_abs_sum, int64_t block, int64_t act) {
  TORCH_CHECK(act == kRelu || act == kRelu2 || act == kDRelu, "act must be 0 (relu), 1 (relu2) or 2 (drelu)");
  TORCH_CHECK(act != kDRelu || w_up.has_value(), "act 2 (drelu) needs w_up");
  TORCH_CHECK(x2.dim() == 2 && x2.is_contiguous(), "x2 must be a contiguous [M, K] tensor");
  TORCH_CHECK(x2.scalar_type() == at::kFloat || x2.scalar_type() == at::kBFloat16,
              "cpu_ffn supports float32 and bfloat16, got ", x2.scalar_type());
  TORCH_CHECK(!w_up.has_value() || w_up->stride(1) == 1, "w_up must have unit column stride");
  const int64_t m = x2.size(0), k = x2.size(1), n = w_gate.size(0), kout = w_down.size(0);
  const bool gated = w_up.has_value();

  at::Tensor hg = at::linear(x2, w_gate, b_gate).contiguous();
  at::Tensor counts = at::empty({m}, x2.options().dtype(at::kInt));
  int32_t* cnt = counts.data_ptr<int32_t>();
  std::vector<int32_t> work(m);  // pairs done sparsely: the count, or 0 for a dense row
  std::vector<uint8_t> dense_row(m, 0);
  const bool fp32 = x2.scalar_type() == at::kFloat;
  if (fp32) relu_pass<float>(x2, hg, gated, cnt, work.data(), dense_row.data());
  else relu_pass<c10::BFloat16>(x2, hg, gated, cnt, work.data(), dense_row.data());

  int64_t nnz = 0;
  for (int64_t r = 0; r < m; ++r) nnz += cnt[r];
  const bool go_dense = m > 0 && n > 0 && static_cast<double>(nnz) > max_density * static_cast<double>(m * n);
  at::Tensor abs_sum = at::zeros({}, x2.options().dtype(at::kFloat));
  if (go_dense) {
    if (act == kRelu2) hg.mul_(hg);
    at::Tensor h = gated ? hg.mul_(up_act(at::linear(x2, *w_up, b_up), act)) : hg;
    if (want_abs_sum) abs_sum = h.abs().sum(at::kFloat);
    return {at::linear(h, w_down, b_down), counts, abs_sum, at::ones({}, x2.options().dtype(at::kBool))};
  }

  at::Tensor y = at::empty({m, kout}, x2.options());
  at::Tensor yacc = fp32 ? y : at::empty({m, kout}, x2.options().dtype(at::kFloat));
  if (b_down.has_value()) yacc.copy_(b_down->to(at::kFloat).expand({m, kout}));
  else yacc.zero_();
  float abs_acc = 0.f;
  float* abs_ptr = want_abs_sum ? &abs_acc : nullptr;
  if (fp32) sparse_up_down<float>(x2, hg, work.data(), w_up, b_up, w_down, yacc.data_ptr<float>(), abs_ptr,
                                                  std::max<int64_t>(1, block), act);
  else sparse_up_down<c10::BFloat16>(x2, hg, work.data(), w_up, b_up, w_down, yacc.data_ptr<float>(), abs_ptr,
                                                  std::max<int64_t>(1, block), act);
  if (!fp32) y.copy_(yacc);

  // Gated rows whose x holds NaN/Inf: dense, exactly as eager.
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < m; ++r)
    if (dense_row[r]) rows.push_back(r);
  if (!rows.empty()) {
    at::Tensor idx = at::tensor(rows, x2.options().dtype(at::kLong));
    at::Tensor xr = x2.index_select(0, idx);
    at::Tensor a = hg.index_select(0, idx);
    if (act == kRelu2) a.mul_(a);
    at::Tensor h = a.mul_(up_act(at::linear(xr, *w_up, b_up), act));
    if (want_abs_sum) abs_acc += h.abs().sum(at::kFloat).item<float>();
    y.index_copy_(0, idx, at::linear(h, w_down, b_down));
  }
  abs_sum.fill_(abs_acc);
  return {y, counts, abs_sum, at::zeros({}, x2.options().dtype(at::kBool))};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ffn_forward", &ffn_forward, "sparse ReLU-family FFN inference on CPU (see cpu_ffn.cpp)", py::arg("x2"),
        py::arg("w_gate"), py::arg("b_gate"), py::arg("w_up"), py::arg("b_up"), py::arg("w_down"), py::arg("b_down"),
        py::arg("max_density"), py::arg("want_abs_sum"), py::arg("block"), py::arg("act") = kRelu);
}
