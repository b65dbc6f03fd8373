// Float and bfloat16 pages, head_dim a multiple of 16, AVX-512F: the query heads that share a
// KV head (up to kHeads of them per pass) read each key and value once, widened in registers,
// for cpu_attention.cc (included there, after `update`).
//
// The general path decodes a group of pages into a float32 buffer (64 KB per group of four
// 32-token bfloat16 pages, past L1) and then walks it once per query head, each key's dot
// product summed across its lanes on its own. Here four keys' products for every head of the
// pass build up in 16 registers (4 keys x 4 heads), summed across lanes only at the end, and
// each value row, widened once, is added into every head's sum. 64 decode rows of 40-170
// tokens, 32-token bfloat16 pages in cache, 3 query heads per KV head (/tmp script, 2-core
// Zen 5): 0.25 -> 0.13 ms a layer, of which the running max's vectorized loop
// (cpu_attention.cc: max_score) is about half. Each query vector's arithmetic does not depend on the other rows or
// queries of the call: a decode row and the same position inside a prefill or a verify chunk
// give the same bits.

#ifdef __AVX512F__
constexpr int64_t kHeads = 4;  // query heads per pass: 4 keys x 4 heads = 16 accumulators

inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const uint16_t* p) {  // bfloat16 bits: exact
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// sc[g * ld + t] = q[g] . k[t] for t in [a, b) and the HG heads' rows of q ([HG, D]).
template <int HG, typename KT>
void scores_heads(const float* q, int64_t D, const KT* k, int64_t a, int64_t b, float* sc,
                  int64_t ld) {
  int64_t t = a;
  for (; t + 4 <= b; t += 4) {
    __m512 s[4][HG];
    for (int j = 0; j < 4; ++j)
      for (int g = 0; g < HG; ++g) s[j][g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
      __m512 kj[4];
      for (int j = 0; j < 4; ++j) kj[j] = widen16(k + (t + j) * D + c);
      for (int g = 0; g < HG; ++g) {
        const __m512 qg = _mm512_loadu_ps(q + g * D + c);
        for (int j = 0; j < 4; ++j) s[j][g] = _mm512_fmadd_ps(qg, kj[j], s[j][g]);
      }
    }
    for (int g = 0; g < HG; ++g)
      for (int j = 0; j < 4; ++j) sc[g * ld + t + j] = _mm512_reduce_add_ps(s[j][g]);
  }
  for (; t < b; ++t)
    for (int g = 0; g < HG; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16)
        s = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c), widen16(k + t * D + c), s);
      sc[g * ld + t] = _mm512_reduce_add_ps(s);
    }
}

// acc[g] += sum over t in [a, b) of w[g * ld + t] v[t], for the HG heads' rows of acc.
template <int HG, typename KT>
void values_heads(const float* w, int64_t ld, const KT* v, int64_t D, int64_t a, int64_t b,
                  float* acc) {
  int64_t t = a;
  for (; t + 4 <= b; t += 4)
    for (int64_t c = 0; c < D; c += 16) {
      __m512 vj[4];
      for (int j = 0; j < 4; ++j) vj[j] = widen16(v + (t + j) * D + c);
      for (int g = 0; g < HG; ++g) {
        const float* wg = w + g * ld + t;
        __m512 x = _mm512_mul_ps(_mm512_set1_ps(wg[0]), vj[0]);
        x = _mm512_fmadd_ps(_mm512_set1_ps(wg[1]), vj[1], x);
        x = _mm512_fmadd_ps(_mm512_set1_ps(wg[2]), vj[2], x);
        x = _mm512_fmadd_ps(_mm512_set1_ps(wg[3]), vj[3], x);
        float* ag = acc + g * D + c;
        _mm512_storeu_ps(ag, _mm512_add_ps(_mm512_loadu_ps(ag), x));
      }
    }
  for (; t < b; ++t)
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 vt = widen16(v + t * D + c);
      for (int g = 0; g < HG; ++g) {
        float* ag = acc + g * D + c;
        _mm512_storeu_ps(ag, _mm512_fmadd_ps(_mm512_set1_ps(w[g * ld + t]), vt,
                                             _mm512_loadu_ps(ag)));
      }
    }
}

// One query's HG heads (rows r .. r + HG of qv, acc, m, l) over keys [t0, nt) of a group of
// np pages (kb, vb: the pages as stored; key t is row t % K of page t / K); sc: [HG, span].
// Every cache line of a group's pages asked for before its first key is read. A (page, KV
// head) is 4 KB of bfloat16 (32 tokens x 64), where the hardware's prefetchers stop, and a
// row's pages lie anywhere in the pool: a decode step's K/V come from DRAM (every layer's
// pages, hundreds of MB at batch 64), and its demand misses alone left the reads waiting.
// 30 layers of 64 rows x 100-160 tokens, each layer's pages apart (/tmp script, 2-core Zen 5):
// 15.7 -> 13.1 ms a step with bfloat16 pages (17.8 before this path).
template <typename KT>
void prefetch_pages(const KT* const* kb, const KT* const* vb, int64_t np, int64_t bytes) {
  for (const KT* const* pages : {kb, vb})
    for (int64_t j = 0; j < np; ++j)
      for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pages[j]) + o, _MM_HINT_T0);
}

template <int HG, typename KT>
void update_heads(const float* qv, float* acc, float* m, float* l, int64_t r, int64_t D,
                  int64_t K, const KT* const* kb, const KT* const* vb, int64_t np, int64_t t0,
                  int64_t nt, float* sc, int64_t span) {
  for_pages(np, K, t0, nt, [&](int64_t j, int64_t a, int64_t b) {
    scores_heads<HG>(qv + r * D, D, kb[j], a, b, sc + j * K, span);
  });
  for (int g = 0; g < HG; ++g) softmax_step(sc + g * span, t0, nt, acc + (r + g) * D, D,
                                            m[r + g], l[r + g]);
  for_pages(np, K, t0, nt, [&](int64_t j, int64_t a, int64_t b) {
    values_heads<HG>(sc + j * K, span, vb[j], D, a, b, acc + r * D);
  });
}

// The G heads of query vector block r (r = i * G) in passes of at most kHeads, as even as
// they split (G = 6: two passes of 3).
template <typename KT>
void update_query(const float* qv, float* acc, float* m, float* l, int64_t r, int64_t G,
                  int64_t D, int64_t K, const KT* const* kb, const KT* const* vb, int64_t np,
                  int64_t t0, int64_t nt, float* sc, int64_t span) {
  const int64_t passes = (G + kHeads - 1) / kHeads, per = (G + passes - 1) / passes;
  for (int64_t g = 0; g < G; g += per) {
    const int64_t hg = std::min(per, G - g);
    if (hg == 4)
      update_heads<4>(qv, acc, m, l, r + g, D, K, kb, vb, np, t0, nt, sc, span);
    else if (hg == 3)
      update_heads<3>(qv, acc, m, l, r + g, D, K, kb, vb, np, t0, nt, sc, span);
    else if (hg == 2)
      update_heads<2>(qv, acc, m, l, r + g, D, K, kb, vb, np, t0, nt, sc, span);
    else
      update_heads<1>(qv, acc, m, l, r + g, D, K, kb, vb, np, t0, nt, sc, span);
  }
}

template <typename KT>
constexpr bool kHeadsPath = std::is_same_v<KT, float> || std::is_same_v<KT, uint16_t>;
#else
template <typename KT>
constexpr bool kHeadsPath = false;

template <typename KT>  // never called without AVX-512F (kHeadsPath is false)
void prefetch_pages(const KT* const*, const KT* const*, int64_t, int64_t) {}

template <typename KT>
void update_query(const float*, float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                  const KT* const*, const KT* const*, int64_t, int64_t, int64_t, float*,
                  int64_t) {}
#endif
