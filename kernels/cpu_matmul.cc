// y = x @ w.T for float32 weights packed in panels, as an XLA FFI custom call (see
// kernels/cpu_matmul.py for why and for the numbers).
//
//   x      [M, K]         activations, row-major
//   panels [P, K, 16]     w [N, K] cut into P = ceil(N / 16) panels of 16 output columns,
//                         each stored k-major (panel p, step k: w[16p .. 16p+15, k]),
//                         zero-padded past N
//   y      [M, N]
//
// The micro-kernel keeps a 6 x 16 tile of y in 12 vector registers and, for every k, loads
// one 64-byte row of the panel and broadcasts 6 scalars of x: 12 FMAs per 8 loads, with the
// panel read sequentially. The weights are the large operand at serving batch sizes (M of a
// few to a few hundred), so they are streamed from memory once per block of MC rows of x,
// and a panel (16 x K floats, 37 KB at K = 576) stays in L2 while the rows of x pass over it.
//
//   for each task (MC rows of x, a run of panels)        XLA's intra-op thread pool
//     for each panel p in the run (AVX-512: two at a time)
//       for each 6 rows of the MC                          micro-kernel, 6 x 16 tile
//                                                          (AVX-512: 6 x 32, by chunks of k)
//
// Int8 and int4 weights (PackedMatmulInt8 / PackedMatmulInt4): codes in blocks of k with
// group scales (cpu_matmul_quant.h), a quarter or an eighth of float32's bytes. Int4 (W4A8)
// multiplies the codes by x's own int8 codes in integer dot products, four rows of x at a
// time. Weight-only codes: for two rows of x or more a task decodes each of its panels once
// into a float32 buffer (16 x K floats, L2-sized) and runs the float micro-kernel on it for
// every row; a single row (batch-1 decode) widens the codes in registers.
//
// Written with GCC vector extensions: the same source builds wherever g++ does, and on x86
// compiles to the FMAs of the ISA it is built for (kernels/cpp_build.py: native, x86-64-v3 =
// AVX2, x86-64-v2 = SSE4.2). The integer dot products use AVX2 / AVX-VNNI intrinsics
// (elsewhere int4 takes the float path); `PagedJaxIsaPaths` says which paths a build holds.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 16;   // output columns per panel (two 8-float vectors)
constexpr int64_t kMR = 6;    // rows of x per micro-kernel call
constexpr int64_t kMC = 96;   // rows of x per task (a multiple of kMR)

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads / stores

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }

#include "cpu_matmul_quant.h"  // int8 / int4 panels, activations quantized per group
#include "cpu_matmul_bf16.h"   // bfloat16 panels

// y[0..mr, 0..cols) = x[0..mr, :] . panel, for mr <= kMR rows and cols <= kNR columns. The
// accumulators are named variables: GCC keeps an array of vectors in memory (a store per FMA).
template <int MR>
void micro(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t cols) {
  const v8 zero = {};
  v8 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  v8 c30 = zero, c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
  for (int64_t k = 0; k < K; ++k) {
    const v8 b0 = load(panel + k * kNR), b1 = load(panel + k * kNR + 8);
#define PJ_ROW(i)                          \
  if (MR > i) {                            \
    const float a = x[i * K + k];          \
    c##i##0 += a * b0;                     \
    c##i##1 += a * b1;                     \
  }
    PJ_ROW(0) PJ_ROW(1) PJ_ROW(2) PJ_ROW(3) PJ_ROW(4) PJ_ROW(5)
#undef PJ_ROW
  }
  float tile[kMR][kNR];
  float* rows[kMR];
#define PJ_OUT(i)                                                                   \
  if (MR > i) {                                                                     \
    rows[i] = cols == kNR ? y + i * ldy : tile[i];  /* a partial panel via the tile */ \
    store(rows[i], c##i##0);                                                        \
    store(rows[i] + 8, c##i##1);                                                    \
  }
  PJ_OUT(0) PJ_OUT(1) PJ_OUT(2) PJ_OUT(3) PJ_OUT(4) PJ_OUT(5)
#undef PJ_OUT
  if (cols < kNR)
    for (int i = 0; i < MR; ++i) std::memcpy(y + i * ldy, tile[i], cols * sizeof(float));
}

// One row (batch-1 decode): four accumulator pairs over interleaved k. With one pair every
// FMA waits for the one before (4 cycles) and the row ran at a quarter of the FMA rate.
void micro_row(const float* x, int64_t K, const float* panel, float* y, int64_t cols) {
  const v8 zero = {};
  v8 a0 = zero, a1 = zero, b0 = zero, b1 = zero, c0 = zero, c1 = zero, d0 = zero, d1 = zero;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* p = panel + k * kNR;
    a0 += x[k] * load(p), a1 += x[k] * load(p + 8);
    b0 += x[k + 1] * load(p + 16), b1 += x[k + 1] * load(p + 24);
    c0 += x[k + 2] * load(p + 32), c1 += x[k + 2] * load(p + 40);
    d0 += x[k + 3] * load(p + 48), d1 += x[k + 3] * load(p + 56);
  }
  for (; k < K; ++k) a0 += x[k] * load(panel + k * kNR), a1 += x[k] * load(panel + k * kNR + 8);
  float tile[kNR];
  store(tile, (a0 + b0) + (c0 + d0));
  store(tile + 8, (a1 + b1) + (c1 + d1));
  std::memcpy(y, tile, cols * sizeof(float));
}

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

// With AVX-512 a panel's row of 16 columns is one vector. Two panels side by side make a 6 x 32
// tile of y in 12 of the 32 registers: per k, 2 panel loads and 6 broadcasts of x feed 12
// FMAs (a 12 x 16 tile needs 13 loads for 12 FMAs, and the loads bound it). The 6 x 16 tile of
// 8-float vectors ran at half the FMA width: on a Zen 5 XLA's dot beat it by 1.5x at 64 rows.
// It runs over k in chunks of kKC, adding each chunk's sums to y, so that the chunk of both
// panels (2 x 16 KB) and of the 6 rows of x (6 KB) stay in L1.
constexpr int64_t kKC = 256;

template <int MR>
void micro16x2(const float* x, int64_t ldx, int64_t kc, const float* pa, const float* pb,
               float* y, int64_t ldy, int64_t cols_b, bool add) {
  const v16 zero = {};
  v16 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero;
  v16 b0 = zero, b1 = zero, b2 = zero, b3 = zero, b4 = zero, b5 = zero;
  for (int64_t k = 0; k < kc; ++k) {
    const v16 wa = *reinterpret_cast<const v16u*>(pa + k * kNR);
    const v16 wb = *reinterpret_cast<const v16u*>(pb + k * kNR);
#define PJ_ROW(i)                  \
  if (MR > i) {                    \
    const float xi = x[i * ldx + k]; \
    a##i += xi * wa;               \
    b##i += xi * wb;               \
  }
    PJ_ROW(0) PJ_ROW(1) PJ_ROW(2) PJ_ROW(3) PJ_ROW(4) PJ_ROW(5)
#undef PJ_ROW
  }
  float tile[kNR];
#define PJ_OUT(i)                                                                     \
  if (MR > i) {                                                                       \
    float* row = y + i * ldy;                                                         \
    *reinterpret_cast<v16u*>(row) = add ? *reinterpret_cast<const v16u*>(row) + a##i : a##i; \
    *reinterpret_cast<v16u*>(tile) = b##i;                                            \
    for (int64_t j = 0; j < cols_b; ++j) row[kNR + j] = (add ? row[kNR + j] : 0.f) + tile[j]; \
  }
  PJ_OUT(0) PJ_OUT(1) PJ_OUT(2) PJ_OUT(3) PJ_OUT(4) PJ_OUT(5)
#undef PJ_OUT
}

// y[0..mr, 0..16 + cols_b) = x[0..mr, :] . (panel a | panel b), mr <= kMR, by chunks of k.
void rows_pair(int64_t mr, const float* x, int64_t K, const float* pa, const float* pb,
               float* y, int64_t ldy, int64_t cols_b) {
  using Micro = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*,
                         int64_t, int64_t, bool);
  static constexpr Micro kMicro[kMR + 1] = {nullptr,       micro16x2<1>, micro16x2<2>,
                                            micro16x2<3>,  micro16x2<4>, micro16x2<5>,
                                            micro16x2<6>};
  for (int64_t k0 = 0; k0 < K; k0 += kKC)
    kMicro[mr](x + k0, K, std::min(kKC, K - k0), pa + k0 * kNR, pb + k0 * kNR, y, ldy, cols_b,
               k0 > 0);
}
constexpr bool kPanelPairs = true;
#else
constexpr bool kPanelPairs = false;
// Never called without AVX-512 (kPanelPairs is false): it lets run_task's branch compile.
void rows_pair(int64_t, const float*, int64_t, const float*, const float*, float*, int64_t,
               int64_t) {}
#endif

void rows_block(int64_t mr, const float* x, int64_t K, const float* panel, float* y,
                int64_t ldy, int64_t cols) {
  switch (mr) {
    case 6: return micro<6>(x, K, panel, y, ldy, cols);
    case 5: return micro<5>(x, K, panel, y, ldy, cols);
    case 4: return micro<4>(x, K, panel, y, ldy, cols);
    case 3: return micro<3>(x, K, panel, y, ldy, cols);
    case 2: return micro<2>(x, K, panel, y, ldy, cols);
    default: return micro_row(x, K, panel, y, cols);
  }
}

struct Problem {
  int64_t M, K, N, P;
  const float* x;
  const void* panels;  // float, int8_t or (int4) uint8_t
  const void* scales;  // int8 / int4: float16 bits [P, K / group, 16] (two-level int4: codes)
  const void* mins;    // int4 only: float16 bits [P, K / group, 16] (two-level: int8 codes)
  const uint16_t* supers;  // two-level int4 only: float16 units [P, K / (32 S), 2, 16]
  int64_t per_super;       // S
  bool quantize_x;         // x is quantized (int4 always: W4A8; int8 where asked: W8A8)
  const QuantRows* xq;   // x quantized when asked (without kIntegerRow pb.x then points at
                         // its dequantized rows)
  int64_t group;
  float* y;
  int64_t panels_per_task, panel_tasks;
  bool bf16 = false;             // bfloat16 panels (cpu_matmul_bf16.h)
  const uint32_t* xb = nullptr;  // x as bfloat16 pairs (AVX-512 BF16, two rows or more; AMX)
  bool amx = false;              // AMX tiles (xb's rows padded to 2 tiles with zeros)

  const uint16_t* bf16_panel(int64_t p) const {
    return static_cast<const uint16_t*>(panels) + p * K * kNR;
  }

  // Panel p's int4 group parameters.
  Int4Params int4(int64_t p) const {
    const int64_t sp = p * (K / group) * kNR;  // 1- or 2-byte elements
    if (supers == nullptr)
      return {static_cast<const uint16_t*>(scales) + sp, static_cast<const uint16_t*>(mins) + sp,
              nullptr, 1};
    return {static_cast<const uint8_t*>(scales) + sp, static_cast<const int8_t*>(mins) + sp,
            supers + p * (K / group / per_super) * 2 * kNR, per_super};
  }

  // Panel p as float32: in place, or int8 / int4 decoded into `buf` ([K, 16]).
  const float* panel(int64_t p, std::vector<float>& buf) const {
    if (bf16) {
      buf.resize(K * kNR);
      decode_panel_bf16(bf16_panel(p), K, buf.data());
      return buf.data();
    }
    if (scales == nullptr) return static_cast<const float*>(panels) + p * K * kNR;
    buf.resize(K * kNR);
    if (mins == nullptr)
      decode_panel8(static_cast<const int8_t*>(panels) + p * K * kNR,
                    static_cast<const uint16_t*>(scales) + p * (K / group) * kNR, group, K,
                    buf.data());
    else
      decode_panel4(static_cast<const uint8_t*>(panels) + p * K * 8, int4(p), K, buf.data());
    return buf.data();
  }
};

// Rows [m0, m1) of x (quantized) against int4 panel p, in integers, four at a time
// (kIntegerRow machines only).
void rows_integer(const Problem& pb, int64_t p, int64_t cols, int64_t m0, int64_t m1) {
#ifdef __AVX2__
  const uint8_t* q = static_cast<const uint8_t*>(pb.panels) + p * pb.K * 8;
  const Int4Params params = pb.int4(p);
  for (int64_t m = m0; m < m1; m += 4) {
    float* y = pb.y + m * pb.N + p * kNR;
    switch (std::min<int64_t>(4, m1 - m)) {
      case 1: micro_rows_int4<1>(*pb.xq, m, pb.K, q, params, y, pb.N, cols); break;
      case 2: micro_rows_int4<2>(*pb.xq, m, pb.K, q, params, y, pb.N, cols); break;
      case 3: micro_rows_int4<3>(*pb.xq, m, pb.K, q, params, y, pb.N, cols); break;
      default: micro_rows_int4<4>(*pb.xq, m, pb.K, q, params, y, pb.N, cols);
    }
  }
#endif
}

// micro(rows, m) for each run of up to six rows of [m0, m1), `rows` the run's length as a
// compile-time constant (a std::integral_constant).
template <typename Micro>
void by_six_rows(int64_t m0, int64_t m1, Micro micro) {
  for (int64_t m = m0; m < m1; m += 6) {
    switch (std::min<int64_t>(6, m1 - m)) {
      case 1: micro(std::integral_constant<int, 1>{}, m); break;
      case 2: micro(std::integral_constant<int, 2>{}, m); break;
      case 3: micro(std::integral_constant<int, 3>{}, m); break;
      case 4: micro(std::integral_constant<int, 4>{}, m); break;
      case 5: micro(std::integral_constant<int, 5>{}, m); break;
      default: micro(std::integral_constant<int, 6>{}, m);
    }
  }
}

// Rows [m0, m1) of x (quantized) against int8 panel p and, where the task holds it, p + 1, in
// integers (AVX-512 VNNI machines only): 1 when it took p + 1 too, else 0.
int64_t rows_int8(const Problem& pb, int64_t p, int64_t p1, int64_t cols, int64_t m0,
                  int64_t m1) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const bool two = p + 1 < p1;
  const int64_t q = two ? p + 1 : p, cols_b = two ? std::min(kNR, pb.N - q * kNR) : 0;
  const int8_t* qa = static_cast<const int8_t*>(pb.panels) + p * pb.K * kNR;
  const int8_t* qb = static_cast<const int8_t*>(pb.panels) + q * pb.K * kNR;
  const uint16_t* sa = static_cast<const uint16_t*>(pb.scales) + p * (pb.K / kGX) * kNR;
  const uint16_t* sb = static_cast<const uint16_t*>(pb.scales) + q * (pb.K / kGX) * kNR;
  by_six_rows(m0, m1, [&](auto rows, int64_t m) {
    float* y = pb.y + m * pb.N + p * kNR;
    micro_rows_int8<decltype(rows)::value>(*pb.xq, m, pb.K, qa, qb, sa, sb, y, pb.N, cols,
                                           cols_b);
  });
  return two ? 1 : 0;
#else
  return 0;
#endif
}

// Rows [m0, m1) of x (quantized) against int4 panel p and, where the task holds it, p + 1,
// on 512-bit vpdpbusd (AVX-512 VNNI machines only): 1 when it took p + 1 too, else 0.
int64_t rows_int4_512(const Problem& pb, int64_t p, int64_t p1, int64_t cols, int64_t m0,
                      int64_t m1) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const bool two = p + 1 < p1;
  const int64_t q = two ? p + 1 : p, cols_b = two ? std::min(kNR, pb.N - q * kNR) : 0;
  const uint8_t* qa = static_cast<const uint8_t*>(pb.panels) + p * pb.K * 8;
  const uint8_t* qb = static_cast<const uint8_t*>(pb.panels) + q * pb.K * 8;
  const Int4Params pa = pb.int4(p), pq = pb.int4(q);
  by_six_rows(m0, m1, [&](auto rows, int64_t m) {
    float* y = pb.y + m * pb.N + p * kNR;
    micro_rows_int4_512<decltype(rows)::value>(*pb.xq, m, pb.K, qa, qb, pa, pq, y, pb.N, cols,
                                               cols_b);
  });
  return two ? 1 : 0;
#else
  return 0;
#endif
}

// Row 0 of x (float) against int8 panel p (weight-only: K not a multiple of 32), the codes
// widened in registers.
void row_float(const Problem& pb, int64_t p, int64_t cols) {
  micro_row_w8(pb.x, pb.K, static_cast<const int8_t*>(pb.panels) + p * pb.K * kNR,
               static_cast<const uint16_t*>(pb.scales) + p * (pb.K / pb.group) * kNR, pb.group,
               pb.y + p * kNR, cols);
}

// Task t: rows [MC * (t / panel_tasks), ...) of x against a run of panels.
void run_task(const Problem& pb, int64_t t, std::vector<float>& buf, std::vector<float>& buf2) {
  const int64_t m0 = kMC * (t / pb.panel_tasks);
  const int64_t p0 = pb.panels_per_task * (t % pb.panel_tasks);
  const int64_t m1 = std::min(pb.M, m0 + kMC), p1 = std::min(pb.P, p0 + pb.panels_per_task);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t cols = std::min(kNR, pb.N - p * kNR);
    if (pb.xq != nullptr && pb.mins == nullptr && kInt8Rows) {  // int8 W8A8, two panels
      p += rows_int8(pb, p, p1, cols, m0, m1);
      continue;
    }
    if (pb.xq != nullptr && pb.mins != nullptr && kInt8Rows) {  // int4 W4A8, 512-bit
      p += rows_int4_512(pb, p, p1, cols, m0, m1);
      continue;
    }
    if (pb.xq != nullptr && pb.mins != nullptr && kIntegerRow) {  // int4 W4A8: integers
      rows_integer(pb, p, cols, m0, m1);
      continue;
    }
    if (pb.M == 1 && pb.scales != nullptr && pb.xq == nullptr) {
      row_float(pb, p, cols);  // one row: the codes widened in registers
      continue;
    }
    if (pb.amx) {  // AMX tiles, any row count: two panels (the last one may be alone)
      const bool two = p + 1 < p1;
      const int64_t cols_b = two ? std::min(kNR, pb.N - (p + 1) * kNR) : 0;
      rows_amx(pb.xb, pb.K, m0, m1, pb.bf16_panel(p), pb.bf16_panel(two ? p + 1 : p),
               pb.y + p * kNR, pb.N, cols, cols_b);
      p += two;
      continue;
    }
    if (pb.bf16 && pb.M == 1) {  // one row: bfloat16 widened in registers
      micro_row_bf16(pb.x, pb.K, pb.bf16_panel(p), pb.y + p * kNR, cols);
      continue;
    }
    if (pb.xb != nullptr) {  // AVX-512 BF16 dot products, two panels (a lone last one
      // twice, its copy not stored: every panel on one path, whatever the batch)
      const bool two = p + 1 < p1;
      const int64_t cols_b = two ? std::min(kNR, pb.N - (p + 1) * kNR) : 0;
      for (int64_t m = m0; m < m1; m += kMR)
        rows_pair_bf16(std::min(kMR, m1 - m), pb.xb + m * (pb.K / 2), pb.K, pb.bf16_panel(p),
                       pb.bf16_panel(two ? p + 1 : p), pb.y + m * pb.N + p * kNR, pb.N, cols,
                       cols_b);
      p += two;
      continue;
    }
    const float* panel = pb.panel(p, buf);
    if (kPanelPairs && pb.M > 1 && p + 1 < p1) {  // two panels at a time (AVX-512)
      const float* next = pb.panel(p + 1, buf2);
      const int64_t cols_b = std::min(kNR, pb.N - (p + 1) * kNR);
      for (int64_t m = m0; m < m1; m += kMR)
        rows_pair(std::min(kMR, m1 - m), pb.x + m * pb.K, pb.K, panel, next,
                  pb.y + m * pb.N + p * kNR, pb.N, cols_b);
      ++p;
      continue;
    }
    for (int64_t m = m0; m < m1; m += kMR)
      rows_block(std::min(kMR, m1 - m), pb.x + m * pb.K, pb.K, panel,
                 pb.y + m * pb.N + p * kNR, pb.N, cols);
  }
}

// The caller and up to num_threads - 1 pool workers take tasks from a shared counter (as in
// cpu_attention.cc); about four tasks per thread even out the threads' finishing times.
void run(ffi::ThreadPool& pool, Problem pb) {
  if (pb.M == 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t row_tasks = (pb.M + kMC - 1) / kMC;
  const int64_t want = std::max<int64_t>(1, 4 * threads / row_tasks);
  pb.panels_per_task = (pb.P + want - 1) / want;
  // Even runs: the paths that take panels two at a time would leave an odd run's last one
  // to a slower single-panel path (P = 36, a 576-wide output: a fifth of its panels)
  pb.panels_per_task += pb.panels_per_task % 2 * (pb.P > 1);
  pb.panel_tasks = (pb.P + pb.panels_per_task - 1) / pb.panels_per_task;
  const int64_t tasks = row_tasks * pb.panel_tasks;
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    Problem pb;
    QuantRows xq;
    std::vector<uint32_t> xb;
    std::vector<float> xr;
  };
  auto shared = std::make_shared<Shared>();
  if (pb.bf16) {  // x rounded to bfloat16 once, on every path alike (batch-invariant sums)
    pb.amx = kAmxBuilt && pb.K % 32 == 0 && amx_granted();
    const bool pairs_only = pb.amx || (kBf16Dot && pb.M > 1);  // no float path reads x
    round_rows_bf16(pb.x, pb.M, pb.K, shared->xb, shared->xr, !pairs_only);
    pb.x = pairs_only ? nullptr : shared->xr.data();
    if (pb.amx)  // whole A tiles: the rows past M are zeros (their sums are never written)
      shared->xb.resize((pb.M + 2 * kAmxRows - 1) / (2 * kAmxRows) * 2 * kAmxRows * pb.K / 2, 0);
    if (pb.amx || (kBf16Dot && pb.M > 1)) pb.xb = shared->xb.data();
  } else if (pb.quantize_x && pb.K % kGX == 0) {  // every path multiplies x quantized
    // The integer paths read the codes; only the float fallbacks need them dequantized.
    const bool integer = pb.mins != nullptr ? kIntegerRow : kInt8Rows && pb.group == kGX;
    shared->xq.set(pb.x, pb.M, pb.K, !integer);
    pb.xq = &shared->xq;
    if (!integer) pb.x = shared->xq.dequant.data();
    if (!integer && pb.mins == nullptr) pb.xq = nullptr;  // int8: the float paths on x's values
  }
  shared->pb = pb;
  auto worker = [shared, tasks]() {
    std::vector<float> buf, buf2;  // int8 / int4: decoded panels
    if (shared->pb.amx) amx_configure();
    for (int64_t t; (t = shared->next.fetch_add(1)) < tasks;) {
      run_task(shared->pb, t, buf, buf2);
      shared->done.fetch_add(1, std::memory_order_release);
    }
    if (shared->pb.amx) amx_release();
  };
  const int64_t helpers = std::min(threads, tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(worker)(worker));
  worker();
  while (shared->done.load(std::memory_order_acquire) < tasks) {
  }  // the last tasks finish on other threads within microseconds
}

// x [M, K], panels [ceil(N / 16), K, 16], y [M, N]: the problem (false if the shapes do not
// fit together).
bool problem(ffi::Buffer<ffi::F32>& x, const void* panels, ffi::Span<const int64_t> pd,
             ffi::ResultBuffer<ffi::F32>& y, Problem& pb, int64_t width = kNR) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != width || pd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] > pd[0] * kNR || yd[1] <= (pd[0] - 1) * kNR)
    return false;
  pb = Problem{xd[0], xd[1], yd[1], pd[0], x.typed_data(), panels, nullptr, nullptr, nullptr,
               1, false, nullptr, 1, y->typed_data(), 0, 0};
  return true;
}

// Scales (and mins) [P, K / G, 16] for a problem's panels: sets pb.group.
bool group_of(ffi::Span<const int64_t> sd, Problem& pb) {
  if (sd.size() != 3 || sd[0] != pb.P || sd[2] != kNR || sd[1] <= 0 || pb.K % sd[1] != 0)
    return false;
  pb.group = pb.K / sd[1];
  return true;
}

constexpr const char* kShapes =
    "packed matmul: expected x [M, K], panels [ceil(N / 16), K, 16] and y [M, N]";

ffi::Error packed_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
  Problem pb;
  if (!problem(x, panels.typed_data(), panels.dimensions(), y, pb))
    return ffi::Error::InvalidArgument(kShapes);
  run(pool, pb);
  return ffi::Error::Success();
}

ffi::Error packed_matmul_int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S8> panels, ffi::Buffer<ffi::F16> scales,
                              ffi::ResultBuffer<ffi::F32> y, int32_t quantize_x) {
  Problem pb;
  if (!problem(x, panels.typed_data(), panels.dimensions(), y, pb))
    return ffi::Error::InvalidArgument(kShapes);
  if (!group_of(scales.dimensions(), pb) || pb.group % 4 != 0)  // blocks of 4 k per group
    return ffi::Error::InvalidArgument(
        "packed int8 matmul: scales must be [P, K / G, 16], G a multiple of 4");
  pb.scales = scales.untyped_data();
  pb.quantize_x = quantize_x != 0 && pb.group == kGX;  // W8A8: x's int8 codes per 32 k
  run(pool, pb);
  return ffi::Error::Success();
}

ffi::Error packed_matmul_bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::U16> panels, ffi::ResultBuffer<ffi::F32> y) {
  Problem pb;
  if (!problem(x, panels.typed_data(), panels.dimensions(), y, pb) || pb.K % 2 != 0)
    return ffi::Error::InvalidArgument(
        "packed bfloat16 matmul: expected x [M, K], panels [ceil(N / 16), K, 16] (K even) "
        "and y [M, N]");
  pb.bf16 = true;
  run(pool, pb);
  return ffi::Error::Success();
}

constexpr const char* kShapes4 =
    "packed int4 matmul: expected x [M, K], panels [ceil(N / 16), K, 8] and y [M, N]";

// An int4 problem's panels and group parameters (scales and mins [P, K / 32, 16]).
ffi::Error int4_problem(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& panels,
                        ffi::Span<const int64_t> sd, ffi::Span<const int64_t> md,
                        ffi::ResultBuffer<ffi::F32>& y, Problem& pb) {
  if (!problem(x, panels.typed_data(), panels.dimensions(), y, pb, 8))
    return ffi::Error::InvalidArgument(kShapes4);
  if (!group_of(sd, pb) || pb.group != kGX || md.size() != 3 ||
      !std::equal(sd.begin(), sd.end(), md.begin()))
    return ffi::Error::InvalidArgument(
        "packed int4 matmul: scales and mins must be [P, K / 32, 16]");
  return ffi::Error::Success();
}

ffi::Error packed_matmul_int4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::U8> panels, ffi::Buffer<ffi::F16> scales,
                              ffi::Buffer<ffi::F16> mins, ffi::ResultBuffer<ffi::F32> y) {
  Problem pb;
  ffi::Error err = int4_problem(x, panels, scales.dimensions(), mins.dimensions(), y, pb);
  if (err.failure()) return err;
  pb.scales = scales.untyped_data(), pb.mins = mins.untyped_data();
  pb.quantize_x = true;  // W4A8 always
  run(pool, pb);
  return ffi::Error::Success();
}

// Two-level int4: scale and min codes [P, K / 32, 16], units [P, K / (32 S), 2, 16].
ffi::Error packed_matmul_int4_coded(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                    ffi::Buffer<ffi::U8> panels, ffi::Buffer<ffi::U8> scales,
                                    ffi::Buffer<ffi::S8> mins, ffi::Buffer<ffi::F16> supers,
                                    ffi::ResultBuffer<ffi::F32> y) {
  Problem pb;
  ffi::Error err = int4_problem(x, panels, scales.dimensions(), mins.dimensions(), y, pb);
  if (err.failure()) return err;
  auto ud = supers.dimensions();
  if (ud.size() != 4 || ud[0] != pb.P || ud[1] <= 0 || (pb.K / kGX) % ud[1] != 0 ||
      ud[2] != 2 || ud[3] != kNR)
    return ffi::Error::InvalidArgument(
        "packed int4 matmul: supers must be [P, K / (32 S), 2, 16]");
  pb.scales = scales.untyped_data(), pb.mins = mins.untyped_data();
  pb.supers = static_cast<const uint16_t*>(supers.untyped_data());
  pb.per_super = pb.K / kGX / ud[1], pb.quantize_x = true;  // W4A8 always
  run(pool, pb);
  return ffi::Error::Success();
}

#include "cpu_tasks.h"  // for_tasks: a call's work shared with the pool's threads
#include "cpu_argmax.h"  // greedy sampling's row argmax
#include "cpu_logprobs.h"  // the sampled rows' logprobs, ranks and top J

}  // namespace

// The ISA-specific paths this build compiled, one bit each (tests/test_cpu_isa.py checks that
// each ISA of kernels/cpp_build.py really selects its own).
extern "C" uint32_t PagedJaxIsaPaths() {
  uint32_t paths = 0;
#ifdef __AVX512F__
  paths |= 1;  // two panels at a time, 16-float vectors
#endif
#ifdef __AVX2__
  paths |= 2;  // integer int4 rows, vector rounding and byte widening
#endif
#ifdef __F16C__
  paths |= 4;  // float16 scales converted in hardware
#endif
#ifdef __AVXVNNI__
  paths |= 8;  // vpdpbusd dot products
#endif
#ifdef __FMA__
  paths |= 16;  // fused multiply-adds
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  paths |= 128;  // int8 W8A8 rows: 512-bit vpdpbusd
#endif
#ifdef __AVX512BF16__
  paths |= 32;  // vdpbf16ps bfloat16 dot products
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  paths |= 64;  // AMX bfloat16 tiles
#endif
  return paths;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmul, packed_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // panels [P, K, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowArgmax, row_argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [S, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [S]

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowArgmaxBlocked, row_argmax_blocked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // blocked ids [S, B]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [S]

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowLogprobs, row_logprobs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tokens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // active [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // chosen [S]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // rank [S]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // top_ids [S, J]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // top_lp [S, J]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmulBf16, packed_matmul_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U16>>()   // panels [P, K, 16] bf16 bits
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmulInt8, packed_matmul_int8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // panels [P, K, 16] int8
                                  .Arg<ffi::Buffer<ffi::F16>>()   // scales [P, K / G, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<int32_t>("quantize_x"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmulInt4, packed_matmul_int4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // panels [P, K, 8] nibbles
                                  .Arg<ffi::Buffer<ffi::F16>>()   // scales [P, K / G, 16]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // mins [P, K / G, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmulInt4Coded, packed_matmul_int4_coded,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // panels [P, K, 8] nibbles
                                  .Arg<ffi::Buffer<ffi::U8>>()    // scale codes [P, K / 32, 16]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // min codes [P, K / 32, 16]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // units [P, K / 32 S, 2, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
