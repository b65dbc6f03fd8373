// Int8 and int4 weights for cpu_matmul.cc (included inside its namespace, after v8 / load /
// store).
//
// A panel of 16 columns holds its codes in blocks of consecutive k, so that one 32-byte load
// gives, for columns 0..7 (or 8..15), four consecutive k in each 32-bit lane: the operand of a
// 4-way byte dot product (AVX2 vpmaddubsw + vpmaddwd, or AVX-VNNI vpdpbusd).
//
//   int8  blocks of 4 k, 64 bytes:  byte (b, c, j) = q[4b + j, c]                  (signed)
//         w = scale * q, a float16 scale per column and group of G k (32, or K)
//   int4  blocks of 8 k, 64 bytes:  byte (b, c, j) = q[8b + j, c] | q[8b + 4 + j, c] << 4
//         w = scale * q + min, q in 0..15, per column and 32 k either a float16 scale and
//         min, or (two-level, as GGUF's K-quants) a uint8 scale code and an int8 min code
//         times a float16 scale unit and min unit per column and S groups ("supers")
//
// Where the weights ask for it (quantize_x: int8 W8A8, int4 W4A8), the activations are
// quantized too, per row and group of 32 k: xq = round(x / s) in int8, s = max |x| / 127 (as llama.cpp's Q8
// activations), and every row multiplies codes in integers; per 32 k,
//
//   sum_k w[k, c] x[k] = scale_c * s * sum_k q[k, c] xq[k]  (+ min_c * s * sum_k xq[k])
//
// Up to four rows share each block of codes as it is unpacked (a prefill then runs at the byte
// dot products' rate, not float FMAs': docs/architecture.md), and a row's integer sums do not
// depend on its batch. Without AVX2 the same xq runs the float path, dequantized. int4 is always
// W4A8 (an int8 weight kept on its 4-bit grid too); int8 whose K is not a multiple of 32 is
// weight-only (W8A16) and multiplies float activations: a single row with the codes widened
// in registers, two rows or more through the float micro-kernel on the decoded panel.

constexpr int64_t kGX = 32;  // k per activation group (and per int4 weight group)

// 8 float16 (raw bits) -> 8 float32.
inline v8 half8(const uint16_t* p) {
#ifdef __F16C__
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) {  // normal, subnormal and zero halves (no inf / nan in scales)
    const uint32_t h = p[i], e = (h >> 10) & 31, m = h & 1023;
    const float mag = e ? std::ldexp(float(m | 1024), int(e) - 25) : std::ldexp(float(m), -24);
    out[i] = (h & 0x8000) ? -mag : mag;
  }
  return out;
#endif
}

// Rows of x quantized per group of kGX: codes, each group's scale and its sum of codes.
struct QuantRows {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> scale;    // [M, K / kGX]
  std::vector<int32_t> sum;    // [M, K / kGX]
  std::vector<float> dequant;  // [M, K]: q * scale, what the float path multiplies (if asked)

  void set(const float* x, int64_t M, int64_t K, bool dequantize) {
    q.resize(M * K), scale.resize(M * K / kGX), sum.resize(M * K / kGX);
    dequant.resize(dequantize ? M * K : 0);
    for (int64_t g = 0; g < M * K / kGX; ++g) group(x + g * kGX, g);
  }

 private:
  void group(const float* x, int64_t g) {
#ifdef __AVX2__
    if (kGX == 32) return group32(x, g);
#endif
    float amax = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < kGX; ++i)
      amax = std::max(amax, std::fabs(x[i])), finite &= std::isfinite(x[i]);
    if (!finite) return nonfinite(g);
    const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int64_t i = 0; i < kGX; ++i) {
      const int32_t v = int32_t(std::lrintf(x[i] * inv));
      q[g * kGX + i] = int8_t(v), total += v;
      if (!dequant.empty()) dequant[g * kGX + i] = float(v) * s;
    }
    scale[g] = s, sum[g] = total;
  }

#ifdef __AVX2__
  // The same codes, scale and sum as the scalar loop (max and integer sums are exact; the
  // conversion rounds to nearest even, as lrintf), 8 lanes at a time: the rows are quantized
  // serially before the tasks start, and the scalar loop took a third of a 64-row down
  // projection (K = 1536) on a 2-core Zen 5.
  void group32(const float* x, int64_t g) {
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(3.4028235e38f);
    __m256 v[4], m = _mm256_setzero_ps();
    int finite = 0xff;
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      const __m256 a = _mm256_andnot_ps(sign, v[j]);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));  // NaN, Inf: 0
      m = _mm256_max_ps(m, a);
    }
    if (finite != 0xff) return nonfinite(g);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    __m256i c[4], t = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
      t = _mm256_add_epi32(t, c[j]);
      if (!dequant.empty())
        _mm256_storeu_ps(&dequant[g * kGX + 8 * j],
                         _mm256_mul_ps(_mm256_cvtepi32_ps(c[j]), _mm256_set1_ps(s)));
    }
    // |codes| <= 127: the saturating packs keep them; they interleave 128-bit lanes, which
    // the permute puts back in order
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                         _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&q[g * kGX]),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1));
    scale[g] = s, sum[g] = _mm_cvtsi128_si32(u);
  }
#endif

  // A NaN or Inf in group g: no code stands for it (lrintf gives an unspecified value, cvtps
  // INT_MIN, and 127 / Inf scales every other x to 0), so the codes are 0 and the scale NaN:
  // every output of the row is NaN (scale * 0), where x @ w gives NaN or +-Inf.
  void nonfinite(int64_t g) {
    std::fill_n(q.begin() + g * kGX, kGX, int8_t(0));
    if (!dequant.empty()) std::fill_n(dequant.begin() + g * kGX, kGX, NAN);
    scale[g] = NAN, sum[g] = 0;
  }
};

// Byte codes are read 32 at a time as 8 int32 lanes: the unaligned types may alias the int8 /
// uint8 buffers (without may_alias that read is undefined behaviour under strict aliasing).
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8u __attribute__((vector_size(32), aligned(1), may_alias));

inline u32x8 codes32(const void* p) { return *static_cast<const u32x8u*>(p); }

// Byte j of each lane, sign-extended: shifted left as unsigned (a negative signed lane shifted
// left is undefined behaviour in C++17), then arithmetically right.
inline v8 byte_lane(u32x8 w, int j) {
  return __builtin_convertvector((i32x8)(w << (24 - 8 * j)) >> 24, v8);
}

// An int8 panel decoded to float32 [K, 16].
void decode_panel8(const int8_t* q, const uint16_t* scales, int64_t group, int64_t K,
                   float* out) {
  for (int64_t g = 0; g < K; g += group, scales += kNR) {
    const v8 s[2] = {half8(scales), half8(scales + 8)};
    for (int64_t b = g; b < g + group; b += 4)
      for (int h = 0; h < 2; ++h) {  // columns 0..7, then 8..15
        const u32x8 w = codes32(q + b * kNR + h * 32);
        for (int j = 0; j < 4; ++j) store(out + (b + j) * kNR + 8 * h, byte_lane(w, j) * s[h]);
      }
  }
}

// 8 bytes -> 8 float32 (uint8_t or int8_t codes, widened with or without their sign).
template <typename T>
inline v8 bytes8(const T* p) {
#ifdef __AVX2__
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (v8)_mm256_cvtepi32_ps(std::is_signed_v<T> ? _mm256_cvtepi8_epi32(b)
                                                    : _mm256_cvtepu8_epi32(b));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = float(p[i]);
  return out;
#endif
}

// An int4 panel's group parameters: float16 scales and mins [K / 32, 16], or (supers set)
// uint8 scale codes and int8 min codes [K / 32, 16] with float16 units [K / (32 S), 2, 16].
struct Int4Params {
  const void* scales;
  const void* mins;
  const uint16_t* supers;
  int64_t per_super;  // S, groups per super

  // Group g's scales s and mins m, columns 0..7 and 8..15.
  void group(int64_t g, v8 s[2], v8 m[2]) const {
    for (int h = 0; h < 2; ++h) {
      const int64_t at = g * kNR + 8 * h;
      if (supers == nullptr) {
        s[h] = half8(static_cast<const uint16_t*>(scales) + at);
        m[h] = half8(static_cast<const uint16_t*>(mins) + at);
      } else {
        const uint16_t* unit = supers + (g / per_super) * 2 * kNR + 8 * h;
        s[h] = half8(unit) * bytes8(static_cast<const uint8_t*>(scales) + at);
        m[h] = half8(unit + kNR) * bytes8(static_cast<const int8_t*>(mins) + at);
      }
    }
  }
};

// An int4 panel decoded to float32 [K, 16].
void decode_panel4(const uint8_t* q, const Int4Params& params, int64_t K, float* out) {
  for (int64_t g = 0; g < K; g += kGX) {
    v8 s[2], m[2];
    params.group(g / kGX, s, m);
    for (int64_t b = g; b < g + kGX; b += 8)
      for (int h = 0; h < 2; ++h) {
        const u32x8 w = codes32(q + b * 8 + h * 32);
        for (int j = 0; j < 4; ++j) {
          const v8 lo = __builtin_convertvector((i32x8)((w >> (8 * j)) & 15), v8);
          const v8 hi = __builtin_convertvector((i32x8)((w >> (8 * j + 4)) & 15), v8);
          store(out + (b + j) * kNR + 8 * h, lo * s[h] + m[h]);
          store(out + (b + 4 + j) * kNR + 8 * h, hi * s[h] + m[h]);
        }
      }
  }
}

inline void store_row(float* y, int64_t cols, v8 a0, v8 a1) {
  float tile[kNR];
  store(tile, a0);
  store(tile + 8, a1);
  std::memcpy(y, tile, cols * sizeof(float));
}

// One float row against an int8 panel (weight-only): the codes widened in registers, four
// accumulators per 8 columns (one per k of a block) so that the FMAs do not wait on each other.
void micro_row_w8(const float* x, int64_t K, const int8_t* q, const uint16_t* scales,
                  int64_t group, float* y, int64_t cols) {
  v8 a[2] = {};
  for (int64_t g = 0; g < K; g += group, scales += kNR) {
    v8 c[2][4] = {};
    for (int64_t b = g; b < g + group; b += 4)
      for (int h = 0; h < 2; ++h) {
        const u32x8 w = codes32(q + b * kNR + h * 32);
        for (int j = 0; j < 4; ++j) c[h][j] += byte_lane(w, j) * x[b + j];
      }
    for (int h = 0; h < 2; ++h)
      a[h] += ((c[h][0] + c[h][1]) + (c[h][2] + c[h][3])) * half8(scales + 8 * h);
  }
  store_row(y, cols, a[0], a[1]);
}

#ifdef __AVX2__
constexpr bool kIntegerRow = true;

// acc (int32 lanes) += the 4-way dot products of unsigned bytes u and signed bytes s.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // u is an int4 code here: pairs stay within int16
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// R quantized rows of x (from row m) against an int4 panel, y's rows `ldy` apart: each
// 32-byte block of codes is loaded and split into nibbles once for all R rows; each row's
// integer sums are the same whatever R is (its float sums may round differently).
template <int R>
void micro_rows_int4(const QuantRows& x, int64_t m, int64_t K, const uint8_t* q,
                     const Int4Params& params, float* y, int64_t ldy, int64_t cols) {
  const __m256i nib = _mm256_set1_epi8(15);
  const int8_t* xq = x.q.data() + m * K;
  const int64_t gs = m * (K / kGX);  // row m's first activation group
  v8 a0[R] = {}, a1[R] = {};
  for (int64_t g = 0; g < K; g += kGX) {
    __m256i c0[R], c1[R];
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_si256();
    for (int64_t b = g; b < g + kGX; b += 8) {
      const __m256i w0 = load256(q + b * 8), w1 = load256(q + b * 8 + 32);
      const __m256i l0 = _mm256_and_si256(w0, nib), l1 = _mm256_and_si256(w1, nib);
      const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), nib);
      const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), nib);
      for (int r = 0; r < R; ++r) {
        int32_t xl, xh;
        std::memcpy(&xl, xq + r * K + b, 4);
        std::memcpy(&xh, xq + r * K + b + 4, 4);
        const __m256i lo = _mm256_set1_epi32(xl), hi = _mm256_set1_epi32(xh);
        c0[r] = dot4(dot4(c0[r], l0, lo), h0, hi);
        c1[r] = dot4(dot4(c1[r], l1, lo), h1, hi);
      }
    }
    v8 ws[2], wm[2];
    params.group(g / kGX, ws, wm);
    for (int r = 0; r < R; ++r) {
      const int64_t i = gs + r * (K / kGX) + g / kGX;
      const float s = x.scale[i], ms = s * float(x.sum[i]);
      a0[r] += (v8)_mm256_cvtepi32_ps(c0[r]) * (ws[0] * s) + wm[0] * ms;
      a1[r] += (v8)_mm256_cvtepi32_ps(c1[r]) * (ws[1] * s) + wm[1] * ms;
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, cols, a0[r], a1[r]);
}
#else
constexpr bool kIntegerRow = false;  // int4 runs the float path on x dequantized
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8Rows = true;

// R <= 6 quantized rows of x (from row m) against int8 panels a and b (W8A8; b may be a again,
// its columns then unused: cols_b = 0; cols_a < 16 for a last panel alone), 32 k (one group
// of x and of the weights) at a time. A 4 k block of a panel is one 64-byte load: 16 columns x
// 4 k, the operand of vpdpbusd (unsigned x signed bytes, 16 int32 sums of 4 products). The
// weights' codes are made unsigned by flipping their top bit (q + 128), so that x's signed
// codes multiply them, and 128 times the row's group sum of codes (QuantRows::sum) is taken
// back: exact integers per group, then the group's scales in float. A row's sums never depend
// on R or on the other panel.
template <int R>
void micro_rows_int8(const QuantRows& x, int64_t m, int64_t K, const int8_t* qa,
                     const int8_t* qb, const uint16_t* sa, const uint16_t* sb, float* y,
                     int64_t ldy, int64_t cols_a, int64_t cols_b) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xq = x.q.data() + m * K;
  const int64_t groups = K / kGX, gs = m * groups;
  __m512 fa[R], fb[R];
  for (int r = 0; r < R; ++r) fa[r] = fb[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i ca[R], cb[R];
    for (int r = 0; r < R; ++r) ca[r] = cb[r] = _mm512_setzero_si512();
    for (int64_t b = g * kGX; b < (g + 1) * kGX; b += 4) {
      const __m512i wa = _mm512_xor_si512(_mm512_loadu_si512(qa + b * kNR), flip);
      const __m512i wb = _mm512_xor_si512(_mm512_loadu_si512(qb + b * kNR), flip);
      for (int r = 0; r < R; ++r) {
        int32_t xr;
        std::memcpy(&xr, xq + r * K + b, 4);
        const __m512i xv = _mm512_set1_epi32(xr);
        ca[r] = _mm512_dpbusd_epi32(ca[r], wa, xv);
        cb[r] = _mm512_dpbusd_epi32(cb[r], wb, xv);
      }
    }
    const __m512 swa = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(sa + g * kNR)));
    const __m512 swb = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(sb + g * kNR)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = gs + r * groups + g;
      const __m512i back = _mm512_set1_epi32(128 * x.sum[i]);
      const __m512 s = _mm512_set1_ps(x.scale[i]);
      fa[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ca[r], back)),
                              _mm512_mul_ps(swa, s), fa[r]);
      fb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(cb[r], back)),
                              _mm512_mul_ps(swb, s), fb[r]);
    }
  }
  float tile[kNR];
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile, fa[r]);
    std::memcpy(y + r * ldy, tile, cols_a * sizeof(float));
    _mm512_storeu_ps(tile, fb[r]);
    std::memcpy(y + r * ldy + kNR, tile, cols_b * sizeof(float));
  }
}

// Two v8 halves (columns 0..7, 8..15) as one 16-float vector (AVX-512F's 256-bit insert:
// the float32x8 one needs AVX-512DQ, which the guard above does not name).
inline __m512 join16(v8 lo, v8 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512((__m256d)lo), (__m256d)hi, 1));
}

// micro_rows_int4's 512-bit form, R <= 6 rows against int4 panels a and b (b may be a again:
// cols_b = 0): a 64-byte block of a panel is 16 columns x 8 k, its low nibbles k 0..3 and its
// high nibbles k 4..7 of each column, each an unsigned operand of vpdpbusd as it is.
template <int R>
void micro_rows_int4_512(const QuantRows& x, int64_t m, int64_t K, const uint8_t* qa,
                         const uint8_t* qb, const Int4Params& pa, const Int4Params& pbp,
                         float* y, int64_t ldy, int64_t cols_a, int64_t cols_b) {
  const __m512i nib = _mm512_set1_epi8(15);
  const int8_t* xq = x.q.data() + m * K;
  const int64_t groups = K / kGX, gs = m * groups;
  __m512 fa[R], fb[R];
  for (int r = 0; r < R; ++r) fa[r] = fb[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i ca[R], cb[R];
    for (int r = 0; r < R; ++r) ca[r] = cb[r] = _mm512_setzero_si512();
    for (int64_t b = g * kGX; b < (g + 1) * kGX; b += 8) {
      const __m512i wa = _mm512_loadu_si512(qa + b * 8), wb = _mm512_loadu_si512(qb + b * 8);
      const __m512i la = _mm512_and_si512(wa, nib), lb = _mm512_and_si512(wb, nib);
      const __m512i ha = _mm512_and_si512(_mm512_srli_epi16(wa, 4), nib);
      const __m512i hb = _mm512_and_si512(_mm512_srli_epi16(wb, 4), nib);
      for (int r = 0; r < R; ++r) {
        int32_t xl, xh;
        std::memcpy(&xl, xq + r * K + b, 4);
        std::memcpy(&xh, xq + r * K + b + 4, 4);
        const __m512i lo = _mm512_set1_epi32(xl), hi = _mm512_set1_epi32(xh);
        ca[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ca[r], la, lo), ha, hi);
        cb[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(cb[r], lb, lo), hb, hi);
      }
    }
    v8 s2[2], m2[2];
    pa.group(g, s2, m2);
    const __m512 swa = join16(s2[0], s2[1]), mwa = join16(m2[0], m2[1]);
    pbp.group(g, s2, m2);
    const __m512 swb = join16(s2[0], s2[1]), mwb = join16(m2[0], m2[1]);
    for (int r = 0; r < R; ++r) {
      const int64_t i = gs + r * groups + g;
      const __m512 s = _mm512_set1_ps(x.scale[i]);
      const __m512 ms = _mm512_set1_ps(x.scale[i] * float(x.sum[i]));
      fa[r] = _mm512_fmadd_ps(mwa, ms, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ca[r]),
                                                      _mm512_mul_ps(swa, s), fa[r]));
      fb[r] = _mm512_fmadd_ps(mwb, ms, _mm512_fmadd_ps(_mm512_cvtepi32_ps(cb[r]),
                                                      _mm512_mul_ps(swb, s), fb[r]));
    }
  }
  float tile[kNR];
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile, fa[r]);
    std::memcpy(y + r * ldy, tile, cols_a * sizeof(float));
    _mm512_storeu_ps(tile, fb[r]);
    std::memcpy(y + r * ldy + kNR, tile, cols_b * sizeof(float));
  }
}
#else
constexpr bool kInt8Rows = false;  // W8A8 runs the float paths on x dequantized
#endif
