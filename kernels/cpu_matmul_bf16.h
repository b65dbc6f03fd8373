// bfloat16 panels for cpu_matmul.cc (included there): half float32's weight bytes.
//
//   panels [P, K / 2, 16, 2] bfloat16 bits: for every pair of k, each of the 16 columns holds
//          (w[c, 2j], w[c, 2j + 1]) in one 32-bit lane, the layout AVX-512 BF16's vdpbf16ps
//          multiplies (16 lanes x 2 products per instruction, float32 sums)
//
// x is rounded to bfloat16 once per call, on every path (so a row's result does not depend on
// the batch it came in). Three paths, the first the machine holds:
//   AMX (AMX-BF16 tiles, K a multiple of 32, the OS grants the tile state): every row count,
//     one row included. A panel's 16 pairs of k are one 1 KB B tile as stored, 16 rows of x
//     one A tile; TDPBF16PS multiplies 16 x 16 x 32 in one instruction (2.8 TFLOP/s a core
//     measured on a Xeon with AMX, against about 0.1-0.2 for AVX-512's FMAs). Each row's sums
//     come from its own row of x and the panel only, in the same order at any batch: batched
//     rows equal one-at-a-time rows bit for bit.
//   AVX-512 BF16, two rows or more: vdpbf16ps on a 6 x 32 tile, half the instructions of
//     float32's FMAs for the same work, on half the bytes.
//   elsewhere (and one row without AMX, where the weights' bytes bound the time): the panels
//     widened to float32, exactly: in registers for one row, else decoded once per task into
//     a float32 panel for the float micro-kernels.

#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

typedef uint32_t u8x32 __attribute__((vector_size(32)));
typedef uint32_t u8x32u __attribute__((vector_size(32), aligned(2)));

inline uint16_t to_bf16(float f) {  // round to nearest even; a NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The even and odd k of 8 columns' pairs, as float32: the low half of each lane shifted up,
// the high half masked (both exact).
inline void widen8(const uint16_t* pairs, v8& even, v8& odd) {
  const u8x32 u = *reinterpret_cast<const u8x32u*>(pairs);
  const u8x32 lo = u << 16, hi = u & 0xffff0000u;
  std::memcpy(&even, &lo, 32);
  std::memcpy(&odd, &hi, 32);
}

// Panel [K / 2, 16, 2] -> float32 [K, 16] (k-major), for the float micro-kernels.
void decode_panel_bf16(const uint16_t* panel, int64_t K, float* out) {
  for (int64_t j = 0; j < K / 2; ++j)
    for (int half = 0; half < 2; ++half) {
      v8 even, odd;
      widen8(panel + j * 2 * kNR + half * kNR, even, odd);
      store(out + 2 * j * kNR + half * 8, even);
      store(out + (2 * j + 1) * kNR + half * 8, odd);
    }
}

// One row of x against a bfloat16 panel, widened in registers: 4 FMAs per pair of k.
void micro_row_bf16(const float* x, int64_t K, const uint16_t* panel, float* y, int64_t cols) {
  const v8 zero = {};
  v8 a0 = zero, a1 = zero, b0 = zero, b1 = zero;
  for (int64_t j = 0; j < K / 2; ++j) {
    v8 e0, o0, e1, o1;
    widen8(panel + j * 2 * kNR, e0, o0);
    widen8(panel + j * 2 * kNR + kNR, e1, o1);
    a0 += x[2 * j] * e0, a1 += x[2 * j] * e1;
    b0 += x[2 * j + 1] * o0, b1 += x[2 * j + 1] * o1;
  }
  float tile[kNR];
  store(tile, a0 + b0);
  store(tile + 8, a1 + b1);
  std::memcpy(y, tile, cols * sizeof(float));
}

// x [M, K] rounded to bfloat16: as pairs of k in 32-bit words (vdpbf16ps's broadcast, AMX's
// A tiles) and, unless `widen` is false (the dot-product paths read only the pairs), widened
// back to float32 (the float paths multiply the same values). AVX-512F rounds 16 at a time
// with to_bf16's integer steps (same bits): done serially before the tasks start, the scalar
// loop cost a third of a 64-row down projection (K = 1536) on a 2-core Zen 5.
void round_rows_bf16(const float* x, int64_t M, int64_t K, std::vector<uint32_t>& pairs,
                     std::vector<float>& widened, bool widen) {
  const int64_t n = M * K;
  pairs.resize(n / 2);
  widened.resize(widen ? n : 0);
  uint16_t* out = reinterpret_cast<uint16_t*>(pairs.data());  // pair i: k = 2i low, 2i + 1 high
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i quiet = _mm512_set1_epi32(0x400000);
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(half, odd));
    const __m512i r = _mm512_srli_epi32(
        _mm512_mask_blend_epi32(nan, up, _mm512_or_si512(u, quiet)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
    if (widen) _mm512_storeu_si512(widened.data() + i, _mm512_slli_epi32(r, 16));
  }
#endif
  for (; i < n; ++i) {
    out[i] = to_bf16(x[i]);
    if (!widen) continue;
    const uint32_t w = static_cast<uint32_t>(out[i]) << 16;
    std::memcpy(&widened[i], &w, 4);
  }
}

#ifdef __AVX512BF16__
constexpr int64_t kKPC = 128;  // pairs of k per chunk: 8 KB of each panel, in L1 with x's rows

// y[0..MR, 0..cols_a) and [16, 16 + cols_b) (+)= xb . (panel a | panel b) over `pairs`
// pairs of k (cols_a < 16 only for the matrix's last panel, then alone: cols_b = 0).
template <int MR>
void micro_bf16x2(const uint32_t* xb, int64_t ldx, int64_t pairs, const uint16_t* pa,
                  const uint16_t* pb, float* y, int64_t ldy, int64_t cols_a, int64_t cols_b,
                  bool add) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero;
  __m512 b0 = zero, b1 = zero, b2 = zero, b3 = zero, b4 = zero, b5 = zero;
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh wa = (__m512bh)_mm512_loadu_si512(pa + j * 2 * kNR);
    const __m512bh wb = (__m512bh)_mm512_loadu_si512(pb + j * 2 * kNR);
#define PJ_ROW(i)                                                              \
  if (MR > i) {                                                                \
    const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[i * ldx + j])); \
    a##i = _mm512_dpbf16_ps(a##i, xi, wa);                                     \
    b##i = _mm512_dpbf16_ps(b##i, xi, wb);                                     \
  }
    PJ_ROW(0) PJ_ROW(1) PJ_ROW(2) PJ_ROW(3) PJ_ROW(4) PJ_ROW(5)
#undef PJ_ROW
  }
  float tile[kNR];
#define PJ_OUT(i)                                                                          \
  if (MR > i) {                                                                            \
    float* row = y + i * ldy;                                                              \
    const __mmask16 ka = static_cast<__mmask16>((1u << cols_a) - 1);                       \
    _mm512_mask_storeu_ps(row, ka, add ? _mm512_add_ps(_mm512_maskz_loadu_ps(ka, row), a##i) \
                                       : a##i);                                            \
    _mm512_storeu_ps(tile, b##i);                                                          \
    for (int64_t c = 0; c < cols_b; ++c) row[kNR + c] = (add ? row[kNR + c] : 0.f) + tile[c]; \
  }
  PJ_OUT(0) PJ_OUT(1) PJ_OUT(2) PJ_OUT(3) PJ_OUT(4) PJ_OUT(5)
#undef PJ_OUT
}

// mr <= 6 rows of x (as bfloat16 pairs) against two panels, by chunks of k.
void rows_pair_bf16(int64_t mr, const uint32_t* xb, int64_t K, const uint16_t* pa,
                    const uint16_t* pb, float* y, int64_t ldy, int64_t cols_a, int64_t cols_b) {
  using Micro = void (*)(const uint32_t*, int64_t, int64_t, const uint16_t*, const uint16_t*,
                         float*, int64_t, int64_t, int64_t, bool);
  static constexpr Micro kMicro[7] = {nullptr,         micro_bf16x2<1>, micro_bf16x2<2>,
                                      micro_bf16x2<3>, micro_bf16x2<4>, micro_bf16x2<5>,
                                      micro_bf16x2<6>};
  const int64_t pairs = K / 2;
  for (int64_t j0 = 0; j0 < pairs; j0 += kKPC)
    kMicro[mr](xb + j0, pairs, std::min(kKPC, pairs - j0), pa + j0 * 2 * kNR,
               pb + j0 * 2 * kNR, y, ldy, cols_a, cols_b, j0 > 0);
}
#else
// Never called without AVX-512 BF16 (kBf16Dot is false): it lets run_task's branch compile.
void rows_pair_bf16(int64_t, const uint32_t*, int64_t, const uint16_t*, const uint16_t*,
                    float*, int64_t, int64_t, int64_t) {}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kAmxRows = 16;  // rows of x per A tile; x's rows are padded to 2 tiles

// Linux hands a process the 8 KB of tile data only when asked (arch_prctl); without it the
// first tile instruction faults. Asked once; false (the AVX-512 BF16 path runs) if refused.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

// Every tile 16 rows of 64 bytes: C 0-3 (16 x 16 float32), A 4-5 (16 x 32 bf16), B 6-7
// (16 pairs of k x 16 columns). Per thread: each worker loads it before its first task.
void amx_configure() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kAmxRows;
  // GCC does not see ldtilecfg read cfg and dropped the loop's stores (a config of 0-row
  // tiles: the first tile instruction faults): this barrier keeps them.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

void amx_release() { _tile_release(); }

// out[0 .. 16 RT, 0 .. 32) = xb rows (RT tiles of 16, as pairs, row stride K / 2 words)
// . (panel a | panel b), over all of K (a multiple of 32); out's row stride is 32 floats.
template <int RT>
void amx_block(const uint32_t* xb, int64_t K, const uint16_t* pa, const uint16_t* pb,
               float* out) {
  _tile_zero(0);
  _tile_zero(1);
  if (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t ldx = K * 2;  // bytes per row of x
  for (int64_t j = 0; j < K / 2; j += 16) {  // 16 pairs = 32 k per step
    _tile_loadd(4, xb + j, ldx);
    _tile_loadd(6, pa + j * 2 * kNR, 64);
    _tile_loadd(7, pb + j * 2 * kNR, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RT == 2) {
      _tile_loadd(5, xb + kAmxRows * (K / 2) + j, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 2 * kNR * 4);
  _tile_stored(1, out + kNR, 2 * kNR * 4);
  if (RT == 2) {
    _tile_stored(2, out + kAmxRows * 2 * kNR, 2 * kNR * 4);
    _tile_stored(3, out + kAmxRows * 2 * kNR + kNR, 2 * kNR * 4);
  }
}

// Rows [m0, m1) of x against panels a and b (b's first cols_b columns; b may be a again,
// cols_b 0), written into y: by two tiles of rows, then one.
void rows_amx(const uint32_t* xb, int64_t K, int64_t m0, int64_t m1, const uint16_t* pa,
              const uint16_t* pb, float* y, int64_t ldy, int64_t cols_a, int64_t cols_b) {
  alignas(64) float out[2 * kAmxRows * 2 * kNR];
  for (int64_t m = m0; m < m1; m += 2 * kAmxRows) {
    const int64_t rows = std::min(2 * kAmxRows, m1 - m);
    if (rows > kAmxRows) amx_block<2>(xb + m * (K / 2), K, pa, pb, out);
    else amx_block<1>(xb + m * (K / 2), K, pa, pb, out);
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(y + (m + i) * ldy, out + i * 2 * kNR, cols_a * sizeof(float));
      std::memcpy(y + (m + i) * ldy + kNR, out + i * 2 * kNR + kNR, cols_b * sizeof(float));
    }
  }
}
constexpr bool kAmxBuilt = true;
#else
constexpr int64_t kAmxRows = 16;
constexpr bool kAmxBuilt = false;
bool amx_granted() { return false; }
void amx_configure() {}
void amx_release() {}
void rows_amx(const uint32_t*, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*,
              float*, int64_t, int64_t, int64_t) {}
#endif
