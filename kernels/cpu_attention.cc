// Ragged paged attention for CPUs, as an XLA FFI custom call (see kernels/cpu_attention.py).
//
// Same contract as paged_jax.attention.paged_attention: row s owns queries
// q[query_start[s] .. query_start[s+1]), the last num_q tokens of its context of seq_lens[s]
// tokens; query i sits at position seq_lens[s] - num_q + i and attends causally to keys
// 0..that position through the row's block table. Tokens past query_start[S] get zeros.
//
// Why C++: XLA:CPU runs the jnp reference as gathers that materialize every page and small
// batched dots at a few GB/s (5 ms per layer at batch 64 on SmolLM2, half the decode step).
// This kernel walks each row's block table in place, one (row, KV head) per task on XLA's
// own intra-op thread pool, with an online softmax: K and V are read once, from the pool.
//
//   for each (row s, KV head h)                       task, XLA thread pool
//     q_i,g <- q[query_start[s] + i, h * G + g] * scale      (G query heads share head h)
//     for each page p of the row (block_tables[s, p]) that some query's window reaches
//       for each query i whose position reaches page p
//         scores over the page's tokens in the query's window (position - window, position];
//         running max m, sum l, acc += w * v
//     out <- acc / l
//
// q and out: f32 or bf16. K/V pages: f32 or bf16 (PagedAttention), or int8 / fp8 (e4m3fn,
// e5m2) with Z f32 scales per token and KV head (PagedAttentionQuant: value d of a row is
// q[d] * scale[d / (D / Z)]). Compute is f32: with AVX-512F, float and bf16 pages (head_dim a
// multiple of 16) are read in place, a KV head's query heads together (cpu_attention_heads.h);
// otherwise each page is decoded to f32 once per task before its dots.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

// libmvec's vector expf (_ZGV*_expf), which glibc's <math.h> declares only when the whole of
// -ffast-math is on: the build keeps NaN and Inf (-fno-finite-math-only, kernels/cpp_build.py),
// and libmvec gives them as expf does (exp(NaN) = NaN, exp(-Inf) = 0).
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__FAST_MATH__)
extern "C" float expf(float) noexcept __attribute__((__simd__("notinbranch")));
#endif

namespace ffi = xla::ffi;

namespace {

#include "cpu_tasks.h"  // for_tasks: a call's work shared with the pool's threads

// The running max before any score: exp(kNoScore - score) is 0 for any real score, where
// -inf would give exp(-inf - -inf) = NaN on a query's first page.
constexpr float kNoScore = -1e30f;

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_f32(int8_t x) { return static_cast<float>(x); }

// fp8 bytes, told apart by type. Decoded with integer arithmetic (the compiler vectorizes it;
// a 256-entry table lookup does not vectorize and made fp8 pages 2x slower than int8 ones):
// the 7 magnitude bits shifted into a float32's exponent and mantissa, the exponent rebiased;
// subnormals (exponent 0) are m * 2^(1 - bias - mbits). Codes for NaN / inf (e4m3fn 0x7F,
// e5m2 exponent 31) decode as finite numbers: kv_quant.quantize clips, so none is ever stored.
struct E4M3 { uint8_t bits; };
struct E5M2 { uint8_t bits; };

template <int kMbits, int kBias>
inline float fp8_to_f32(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  const uint32_t normal = (mag << (23 - kMbits)) + (static_cast<uint32_t>(127 - kBias) << 23);
  float f;
  std::memcpy(&f, &normal, sizeof f);
  const float sub = static_cast<float>(mag) * std::ldexp(1.0f, 1 - kBias - kMbits);
  f = (mag >> kMbits) ? f : sub;
  return (b & 0x80u) ? -f : f;
}
inline float to_f32(E4M3 x) { return fp8_to_f32<3, 7>(x.bits); }
inline float to_f32(E5M2 x) { return fp8_to_f32<2, 15>(x.bits); }

// One [K, D] page as f32 rows; with `scale` ([K, Z]) each group of D / Z values of a row is
// multiplied by its own scale. f32 pages are used in place.
template <typename KT>
const float* page_f32(const KT* src, const float* scale, float* dst, int64_t K, int64_t D,
                      int64_t Z) {
  if constexpr (std::is_same_v<KT, float>) {
    return src;
  } else {
    const int64_t w = D / Z;  // values per scale
#ifdef __AVX512F__
    if constexpr (std::is_same_v<KT, uint16_t>) {  // bfloat16 bits: widened 16 at a time
      if (scale == nullptr && (K * D) % 16 == 0) {
        for (int64_t i = 0; i < K * D; i += 16) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
          _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(
                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
        }
        return dst;
      }
    }
#endif
    for (int64_t t = 0; t < K; ++t)
      for (int64_t g = 0; g < Z; ++g) {
        const float f = scale ? scale[t * Z + g] : 1.0f;
        const KT* in = src + t * D + g * w;
        float* o = dst + t * D + g * w;
#pragma omp simd
        for (int64_t d = 0; d < w; ++d) o[d] = to_f32(in[d]) * f;
      }
    return dst;
  }
}

inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  *out = static_cast<uint16_t>(bits >> 16);
}

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim;       // q: [T, Q, D]
  int64_t num_kv_heads, num_blocks, block_size;    // k, v: [H, N, K, D]
  int64_t num_rows, pages_per_row;                 // block_tables: [S, P]
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  float scale;
  int64_t window;  // sliding window in tokens; 0 = none (every earlier key)
};

// Scales of the quantized pages ([H, N, K, groups]); null for float pages.
struct Scales {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t groups = 1;
};

// sc[t] = q . k[t] for t in [t0, nt): four keys per pass, so that four sums build up side by
// side (one key at a time, each 64-wide sum waited on its own chain and horizontal add).
// `python -m kernels.cpu_attention` (64 decode rows, float32 pages): 0.59 -> 0.43 ms.
inline void scores(const float* q, const float* k, int64_t D, int64_t t0, int64_t nt,
                   float* sc) {
  int64_t t = t0;
  for (; t + 4 <= nt; t += 4) {
    const float *k0 = k + t * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t d = 0; d < D; ++d)
      s0 += q[d] * k0[d], s1 += q[d] * k1[d], s2 += q[d] * k2[d], s3 += q[d] * k3[d];
    sc[t] = s0, sc[t + 1] = s1, sc[t + 2] = s2, sc[t + 3] = s3;
  }
  for (; t < nt; ++t) {
    const float* kr = k + t * D;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kr[d];
    sc[t] = dot;
  }
}

// acc += sum of w[t] v[t] over [t0, nt): four values per pass over acc (one load and store of
// acc for four tokens' products).
inline void weigh_values(const float* w, const float* v, int64_t D, int64_t t0, int64_t nt,
                         float* acc) {
  int64_t t = t0;
  for (; t + 4 <= nt; t += 4) {
    const float *v0 = v + t * D, *v1 = v0 + D, *v2 = v1 + D, *v3 = v2 + D;
    const float w0 = w[t], w1 = w[t + 1], w2 = w[t + 2], w3 = w[t + 3];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d)
      acc[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d]);
  }
  for (; t < nt; ++t) {
    const float wt = w[t];
    const float* vr = v + t * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += wt * vr[d];
  }
}

// Pages taken together by one online-softmax update: the max, exp and rescale run once for
// their keys (per page, that bookkeeping cost about as much as the dot products).
constexpr int64_t kGroupPages = 4;

// max(m, sc[t0, nt)), a NaN score skipped (std::max(m, NaN) keeps m; vmaxps returns its second
// operand when either is NaN). The scalar loop waited on each comparison in turn: a quarter of
// a decode row's attention (perf).
inline float max_score(const float* sc, int64_t t0, int64_t nt, float m) {
  int64_t t = t0;
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(m);
  for (; t + 16 <= nt; t += 16) mv = _mm512_max_ps(_mm512_loadu_ps(sc + t), mv);
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; t < nt; ++t) m = std::max(m, sc[t]);
  return m;
}

// The online softmax's step over one query vector's scores sc[t0, nt): the running max m and
// sum l updated, acc ([D]) rescaled, and sc turned into the keys' weights.
inline void softmax_step(float* sc, int64_t t0, int64_t nt, float* acc, int64_t D, float& m,
                         float& l) {
  float mx = max_score(sc, t0, nt, m);
  const float corr = std::exp(m - mx);  // 0 on the first page (m = kNoScore)
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = t0; t < nt; ++t) {  // vectorized exp (libmvec, -ffast-math)
    sc[t] = std::exp(sc[t] - mx);
    sum += sc[t];
  }
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  l = l * corr + sum;
  m = mx;
}

// fn(j, a, b) for each page j < np of a group holding some of keys [t0, nt): its rows [a, b).
template <typename Fn>
inline void for_pages(int64_t np, int64_t K, int64_t t0, int64_t nt, Fn fn) {
  for (int64_t j = 0; j < np; ++j) {
    const int64_t a = std::max<int64_t>(t0 - j * K, 0), b = std::min<int64_t>(nt - j * K, K);
    if (a < b) fn(j, a, b);
  }
}

// Query vector r's online softmax over keys [t0, nt) of a group of np pages (key t is row
// t % K of page t / K): scores, the running max and sum, and acc rescaled and added to.
inline void update(const float* qv, float* acc, float* m, float* l, int64_t r, int64_t D,
                   int64_t K, const float* const* kb, const float* const* vb, int64_t np,
                   int64_t t0, int64_t nt, float* sc) {
  const float* qr = qv + r * D;
  for_pages(np, K, t0, nt, [&](int64_t j, int64_t a, int64_t b) {
    scores(qr, kb[j], D, a, b, sc + j * K);
  });
  float* ar = acc + r * D;
  softmax_step(sc, t0, nt, ar, D, m[r], l[r]);
  for_pages(np, K, t0, nt, [&](int64_t j, int64_t a, int64_t b) {
    weigh_values(sc + j * K, vb[j], D, a, b, ar);
  });
}

#include "cpu_attention_heads.h"  // float / bfloat16 pages: a KV head's query heads at once

template <typename T, typename KT>
void attend(const Problem& pb, const T* q, const KT* k, const KT* v, Scales scales, T* out,
            int64_t s, int64_t h, std::vector<float>& work) {
  const int64_t q0 = pb.query_start[s], nq = pb.query_start[s + 1] - q0;
  const int64_t len = std::min<int64_t>(pb.seq_lens[s], pb.pages_per_row * pb.block_size);
  if (nq <= 0 || len <= 0 || q0 < 0 || q0 + nq > pb.num_tokens) return;
  const int64_t G = pb.num_q_heads / pb.num_kv_heads, D = pb.head_dim, K = pb.block_size;
  const int64_t n = nq * G;  // query vectors of this task
  const int64_t span = kGroupPages * K;  // keys of one online-softmax update
  // resized, not cleared: every buffer but acc and l is written before it is read
  work.resize(n * D * 2 + n * 2 + span + 2 * span * D);
  float* qv = work.data();         // [n, D] scaled queries
  float* acc = qv + n * D;         // [n, D] running sum of w * v
  float* m = acc + n * D;          // [n] running max
  float* l = m + n;                // [n] running sum of w
  float* sc = l + n;               // [span] a group of pages' scores
  float* kpage = sc + span;        // [span, D] the group's keys in f32
  float* vpage = kpage + span * D; // [span, D] its values
  std::fill(acc, acc + n * D, 0.0f);
  std::fill(m, m + n, kNoScore);
  std::fill(l, l + n, 0.0f);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + ((q0 + i) * pb.num_q_heads + h * G + g) * D;
      float* row = qv + (i * G + g) * D;
      for (int64_t d = 0; d < D; ++d) row[d] = to_f32(src[d]) * pb.scale;
      // A NaN or Inf in q: every score NaN, so the output is NaN, as the float64 softmax's
      // (Inf - Inf); an Inf alone would give -Inf scores, which kNoScore turns into zeros.
      if (!std::all_of(row, row + D, [](float x) { return std::isfinite(x); }))
        std::fill(row, row + D, NAN);
    }
  const int64_t first_pos = len - nq;  // position of query 0
  const int64_t pages = (len + K - 1) / K;
  const int64_t win = pb.window > 0 ? pb.window : len + 1;
  // Pages wholly before query 0's window are never read: a local layer's decode costs its
  // window, not its context.
  // Float and bfloat16 pages with AVX-512F: read in place, every query head of the KV head
  // at once (cpu_attention_heads.h); a quantized page is decoded to float32 first.
  const bool heads = kHeadsPath<KT> && scales.k == nullptr && D % 16 == 0;
  const float* kb[kGroupPages];
  const float* vb[kGroupPages];
  const KT* kraw[kGroupPages];
  const KT* vraw[kGroupPages];
  for (int64_t p0 = std::max<int64_t>(0, first_pos - win + 1) / K; p0 < pages;
       p0 += kGroupPages) {
    const int64_t np = std::min(kGroupPages, pages - p0);
    for (int64_t j = 0; j < np; ++j) {
      int64_t block = pb.block_tables[s * pb.pages_per_row + p0 + j];
      block = std::clamp<int64_t>(block, 0, pb.num_blocks - 1);  // a bad table cannot read out
      const int64_t base = (h * pb.num_blocks + block) * K;  // first token of the page
      kraw[j] = k + base * D, vraw[j] = v + base * D;
      if (heads) continue;
      const int64_t ng = scales.groups, sb = base * ng;  // the page's first scale
      kb[j] = page_f32(k + base * D, scales.k ? scales.k + sb : nullptr, kpage + j * K * D, K,
                       D, ng);
      vb[j] = page_f32(v + base * D, scales.v ? scales.v + sb : nullptr, vpage + j * K * D, K,
                       D, ng);
    }
    if constexpr (kHeadsPath<KT>)
      if (heads) prefetch_pages(kraw, vraw, np, K * D * int64_t(sizeof(KT)));
    const int64_t tok0 = p0 * K;
    for (int64_t i = std::max<int64_t>(0, tok0 - first_pos); i < nq; ++i) {
      const int64_t nt = std::min(np * K, first_pos + i - tok0 + 1);  // tokens <= position
      const int64_t t0 = std::max<int64_t>(0, first_pos + i - win + 1 - tok0);  // in window
      if (t0 >= nt) continue;
      if constexpr (kHeadsPath<KT>)
        if (heads) {
          update_query(qv, acc, m, l, i * G, G, D, K, kraw, vraw, np, t0, nt, kpage, span);
          continue;
        }
      for (int64_t g = 0; g < G; ++g)
        update(qv, acc, m, l, i * G + g, D, K, kb, vb, np, t0, nt, sc);
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      // l = 0: the query saw no key (zeros); a NaN l (a NaN or Inf in q) stays NaN.
      const float inv = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
      T* dst = out + ((q0 + i) * pb.num_q_heads + h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) from_f32(acc[r * D + d] * inv, dst + d);
    }
}

// Runs every (row, KV head) task on the caller and up to num_threads - 1 pool workers
// (cpu_tasks.h); each thread keeps its own work buffer.
template <typename T, typename KT>
void run_tasks(ffi::ThreadPool& pool, const Problem& pb, const T* q, const KT* k, const KT* v,
               Scales scales, T* out) {
  const int64_t tasks = pb.num_rows * pb.num_kv_heads;
  for_tasks(pool, tasks, std::min<int64_t>(pool.num_threads(), tasks) - 1, [&](int64_t t) {
    thread_local std::vector<float> work;
    attend(pb, q, k, v, scales, out, t / pb.num_kv_heads, t % pb.num_kv_heads, work);
  });
}

// q, out [T, Q, D]; k, v [H, N, K, D] (H dividing Q, N > 0); tables [S, P]; lens [S];
// starts [S + 1]: the kernel reads nothing outside these.
bool consistent(ffi::AnyBuffer& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                ffi::Buffer<ffi::S32>& tables, ffi::Buffer<ffi::S32>& lens,
                ffi::Buffer<ffi::S32>& starts, ffi::AnyBuffer& out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tables.dimensions();
  auto od = out.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) return false;
  const bool same_kv = std::equal(kd.begin(), kd.end(), vd.begin(), vd.end());
  const bool same_out = std::equal(qd.begin(), qd.end(), od.begin(), od.end());
  return same_kv && same_out && kd[0] > 0 && kd[1] > 0 && qd[1] % kd[0] == 0 &&
         kd[3] == qd[2] && int64_t(lens.element_count()) >= td[0] &&
         int64_t(starts.element_count()) > td[0];
}

template <typename T, typename KT>
ffi::Error launch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  Scales scales, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                  ffi::Buffer<ffi::S32> starts, float scale, int32_t window,
                  ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (!consistent(q, k, v, tables, lens, starts, *out))
    return ffi::Error::InvalidArgument("paged attention: inconsistent q / k / v / table shapes");
  Problem pb{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[0], td[1],
             tables.typed_data(), lens.typed_data(), starts.typed_data(), scale, window};
  T* o = static_cast<T*>(out->untyped_data());
  std::memset(o, 0, out->size_bytes());  // padding tokens and empty rows read zeros
  run_tasks(pool, pb, static_cast<const T*>(q.untyped_data()),
            static_cast<const KT*>(k.untyped_data()), static_cast<const KT*>(v.untyped_data()),
            scales, o);
  return ffi::Error::Success();
}

// Float pages are read in their own dtype under a query of either: a float32 model over a
// bfloat16 cache decodes each page once per task instead of casting the pool every step.
template <typename T>
ffi::Error launch_float(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                        ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> starts, float scale,
                        int32_t window, ffi::Result<ffi::AnyBuffer> out) {
  switch (k.element_type()) {
    case ffi::DataType::F32:
      return launch<T, float>(pool, q, k, v, {}, tables, lens, starts, scale, window, out);
    case ffi::DataType::BF16:
    case ffi::DataType::U16:  // bfloat16 pages stored as their bits (kernels/pages.py)
      return launch<T, uint16_t>(pool, q, k, v, {}, tables, lens, starts, scale, window, out);
    default:
      return ffi::Error::InvalidArgument("paged attention: K/V must be float32 or bfloat16");
  }
}

ffi::Error dispatch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                    ffi::Buffer<ffi::S32> starts, float scale, int32_t window,
                    ffi::Result<ffi::AnyBuffer> out) {
  if (k.element_type() != v.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged attention: k / v and q / out must share dtypes");
  switch (q.element_type()) {
    case ffi::DataType::F32:
      return launch_float<float>(pool, q, k, v, tables, lens, starts, scale, window, out);
    case ffi::DataType::BF16:
      return launch_float<uint16_t>(pool, q, k, v, tables, lens, starts, scale, window, out);
    default:
      return ffi::Error::InvalidArgument("paged attention: q must be float32 or bfloat16");
  }
}

template <typename T>
ffi::Error launch_quant(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, Scales sc, ffi::Buffer<ffi::S32> tables,
                        ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> starts, float scale,
                        int32_t window, ffi::Result<ffi::AnyBuffer> out, bool e5m2) {
  switch (k.element_type()) {
    case ffi::DataType::U8:  // fp8 pages stored as their bits (kernels/pages.py)
      if (e5m2)
        return launch<T, E5M2>(pool, q, k, v, sc, tables, lens, starts, scale, window, out);
      return launch<T, E4M3>(pool, q, k, v, sc, tables, lens, starts, scale, window, out);
    case ffi::DataType::S8:
      return launch<T, int8_t>(pool, q, k, v, sc, tables, lens, starts, scale, window, out);
    case ffi::DataType::F8E4M3FN:
      return launch<T, E4M3>(pool, q, k, v, sc, tables, lens, starts, scale, window, out);
    case ffi::DataType::F8E5M2:
      return launch<T, E5M2>(pool, q, k, v, sc, tables, lens, starts, scale, window, out);
    default:
      return ffi::Error::InvalidArgument("paged attention: quantized K/V must be int8 or fp8");
  }
}

ffi::Error dispatch_quant(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> tables,
                          ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> starts, float scale,
                          int32_t window, int32_t e5m2, ffi::Result<ffi::AnyBuffer> out) {
  if (k.element_type() != v.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged attention: k / v and q / out must share dtypes");
  auto sd = k_scale.dimensions(), kd = k.dimensions(), vsd = v_scale.dimensions();
  if (sd.size() != 4 || kd.size() != 4 || sd[3] <= 0 || kd[3] % sd[3] != 0 ||
      !std::equal(sd.begin(), sd.begin() + 3, kd.begin()) ||
      !std::equal(sd.begin(), sd.end(), vsd.begin(), vsd.end()))
    return ffi::Error::InvalidArgument(
        "paged attention: scales must be [H, N, K, Z] with Z dividing head_dim");
  const Scales sc{k_scale.typed_data(), v_scale.typed_data(), sd[3]};
  switch (q.element_type()) {
    case ffi::DataType::F32:
      return launch_quant<float>(pool, q, k, v, sc, tables, lens, starts, scale, window, out,
                                     e5m2);
    case ffi::DataType::BF16:
      return launch_quant<uint16_t>(pool, q, k, v, sc, tables, lens, starts, scale, window, out,
                                     e5m2);
    default:
      return ffi::Error::InvalidArgument("paged attention: q must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [T, Q, D]
                                  .Arg<ffi::AnyBuffer>()         // k_pages [H, N, K, D]
                                  .Arg<ffi::AnyBuffer>()         // v_pages [H, N, K, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [S + 1]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window")       // 0 = no sliding window
                                  .Ret<ffi::AnyBuffer>());       // out [T, Q, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionQuant, dispatch_quant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [T, Q, D]
                                  .Arg<ffi::AnyBuffer>()         // k_pages [H, N, K, D] int8/fp8
                                  .Arg<ffi::AnyBuffer>()         // v_pages [H, N, K, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [H, N, K, Z]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale [H, N, K, Z]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [S + 1]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window")       // 0 = no sliding window
                                  .Attr<int32_t>("e5m2")         // uint8 pages hold e5m2
                                  .Ret<ffi::AnyBuffer>());       // out [T, Q, D]
