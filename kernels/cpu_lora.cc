// The batched LoRA delta on CPUs (Punica's shrink and expand over a batch that mixes
// adapters), added to a projection's output, called through XLA's FFI: kernels/cpu_lora.py
// wraps it, models/lora_ops.py chooses it on CPU.
//
// Why a kernel: the XLA form of the grouped delta is a loop over tiles of each adapter's
// tokens, and on XLA:CPU every trip of a while loop costs about 20 us whatever its work; and
// around it a cast, a concatenation and an add are each a pass of their own. Here one call
// per fused projection sorts its tokens by adapter slot (a counting sort of a few dozen ids),
// runs each slot's tokens, up to four at a time (a job: shrink, then expand, a slot's
// weights streamed once for its four tokens; jobs shared out among the pool's threads), and
// adds the result into the projection's output:
//
//   LoraAdd  x [T, I], y [T, O], slots [T], a [N, kR, I], b_1 [N, R, O_1] .. b_k [N, R, O_k]
//            -> y + delta [T, O], O = O_1 + .. + O_k (y's buffer, updated in place where XLA
//            lets it), where delta[t] = (h[t, iR:(i+1)R] @ b_i[slot[t]])_i side by side and
//            h[t] = a[slot[t]] @ x[t]
//
// Tokens of slot -1 (no adapter) keep y, and so does a slot outside [0, N) (never sent by
// the engine). x and y are float32 or bfloat16, the weights float32 or bfloat16 bits; sums
// are float32, each output's in one order whatever the batch holds (built without fast-math's
// reordering or contraction: kernels/cpu_lora.py's NO_REORDER), so a token's result is the
// same alone or in any batch. A bfloat16 y is rounded once, after the add (to nearest even).

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#include "cpu_tasks.h"  // for_tasks: a call's work shared with the pool's threads

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

inline float widen(float w) { return w; }
inline float widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bfloat16 bits, to nearest even (a NaN stays a quiet NaN).
inline void narrow(float v, float* out) { *out = v; }
inline void narrow(float v, uint16_t* out) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  *out = v != v ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

constexpr int kStrip = 64, kTok = 4;  // outputs of an expand strip; tokens a weight serves
constexpr int kMaxTargets = 4;        // b's per fused projection (q|k|v: 3)

// kT tokens' dot products with one weight row, the row read once for all of them. Each
// token's sum runs in kLanes lanes over the same positions, then the lanes are added in a
// fixed order: a token's result does not depend on kT, so a delta is the same alone or in
// any batch.
constexpr int kLanes = 16, kChains = 4;
#ifdef __AVX512F__
inline __m512 lanes(const float* w, __mmask16 m) { return _mm512_maskz_loadu_ps(m, w); }
inline __m512 lanes(const uint16_t* w, __mmask16 m) {  // bfloat16 bits widened to float32
  const __m256i bits = _mm256_maskz_loadu_epi16(m, w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename W, int kT>
void dots(const W* w, const float* const* xs, int64_t n, float* out) {
  __m512 acc[kT][kChains];  // chunk c of 16 goes to chain c % kChains: independent FMAs
  for (int q = 0; q < kT; ++q)
    for (int c = 0; c < kChains; ++c) acc[q][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kChains * kLanes <= n; i += kChains * kLanes)
    for (int c = 0; c < kChains; ++c) {
      const __m512 v = lanes(w + i + c * kLanes, 0xFFFF);
      for (int q = 0; q < kT; ++q)
        acc[q][c] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xs[q] + i + c * kLanes), acc[q][c]);
    }
  for (int c = 0; i < n; i += kLanes, ++c) {
    const __mmask16 m = n - i >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = lanes(w + i, m);
    for (int q = 0; q < kT; ++q)
      acc[q][c] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(m, xs[q] + i), acc[q][c]);
  }
  for (int q = 0; q < kT; ++q)
    out[q] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[q][0], acc[q][1]),
                                                _mm512_add_ps(acc[q][2], acc[q][3])));
}
#else
template <typename W, int kT>
void dots(const W* w, const float* const* xs, int64_t n, float* out) {
  float acc[kT][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int q = 0; q < kT; ++q)
      for (int l = 0; l < kLanes; ++l) acc[q][l] = fma(widen(w[i + l]), xs[q][i + l], acc[q][l]);
  for (int l = 0; i + l < n; ++l)
    for (int q = 0; q < kT; ++q) acc[q][l] = fma(widen(w[i + l]), xs[q][i + l], acc[q][l]);
  for (int q = 0; q < kT; ++q) {
    for (int half = kLanes / 2; half > 0; half /= 2)
      for (int l = 0; l < half; ++l) acc[q][l] += acc[q][l + half];
    out[q] = acc[q][0];
  }
}
#endif

// Token ids grouped by slot (counting sort, stable): ids[starts[j]..starts[j + 1]) are slot
// j's tokens; tokens of no slot (or an invalid one) are left out.
void group(const int32_t* slots, int64_t t, int64_t n, std::vector<int64_t>& ids,
           std::vector<int64_t>& starts) {
  starts.assign(n + 1, 0);
  for (int64_t i = 0; i < t; ++i)
    if (slots[i] >= 0 && slots[i] < n) ++starts[slots[i] + 1];
  for (int64_t j = 0; j < n; ++j) starts[j + 1] += starts[j];
  ids.resize(starts[n]);
  std::vector<int64_t> at(starts.begin(), starts.end() - 1);
  for (int64_t i = 0; i < t; ++i)
    if (slots[i] >= 0 && slots[i] < n) ids[at[slots[i]]++] = i;
}

// Runs part(0..parts) on the caller and the pool's workers (cpu_tasks.h): a worker that
// wakes late finds none left and the caller has done them, so a slow hand-off costs nothing
// but the parts it would have taken.
template <typename F>
void in_parts(ffi::ThreadPool& pool, int64_t parts, F part) {
  for_tasks(pool, parts, std::min<int64_t>(pool.num_threads(), parts) - 1, part);
}

// How many parts a call's work is cut into: one under kParallelWork multiply-adds (a pool
// hand-off costs microseconds), else four per thread (they even out the threads' finishing).
constexpr int64_t kParallelWork = 1 << 16;
int64_t parts_for(ffi::ThreadPool& pool, int64_t work) {
  return work < kParallelWork ? 1 : 4 * std::max<int64_t>(1, pool.num_threads());
}

// The call: every operand as a pointer, and the tokens grouped by slot.
struct Call {
  const float* x;  // [T, I], float32 (a bfloat16 x is widened first)
  const void* y;
  void* out;
  const int32_t* slots;
  const void* a;
  const void* b[kMaxTargets];
  int64_t o[kMaxTargets], off[kMaxTargets];
  int64_t t, n, in, kr, rank, width, k;
  std::vector<int64_t> ids, starts;
  std::vector<int64_t> jobs;  // each job's first index in ids (run_job)
};

// out[tok, o0..o1) = y + the strip's delta (at most kStrip outputs of one target) for kT
// tokens of one slot: the strip's sums held in registers across the R rows of b (each weight
// read once for the kT tokens); each output sums its R products in order, whatever kT.
#ifdef __AVX512F__
inline void store(float* dst, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(dst, m, v); }
inline void store(uint16_t* dst, __mmask16 m, __m512 v) {  // to nearest even, as narrow()
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(dst, m, _mm512_cvtepi32_epi16(r));
}

inline __mmask16 mask(int64_t left) {
  return left >= kLanes ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

template <typename W, typename Y, int kT>
void expand_strip(const W* b, const float* const* hs, const Y* const* ys, Y* const* outs,
                  int64_t rank, int64_t o_width, int64_t o0, int64_t o1, int64_t col) {
  constexpr int kS = kStrip / kLanes;  // vectors a strip: independent chains of FMAs
  __mmask16 m[kS];
  for (int v = 0; v < kS; ++v) m[v] = mask(o1 - o0 - v * kLanes);
  __m512 acc[kT][kS];
  for (int q = 0; q < kT; ++q)
    for (int v = 0; v < kS; ++v) acc[q][v] = _mm512_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    const W* row = b + r * o_width + o0;
    // the next strip's lines of this row: the R rows are R strided streams, more than the
    // hardware prefetcher follows at once (measured: the expand of 16 adapters' tokens ran
    // at a third of the shrink's bandwidth without it)
    for (int64_t line = 0; line < kStrip * int64_t(sizeof(W)); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + 2 * kStrip) + line, _MM_HINT_T0);
    __m512 hr[kT];
    for (int q = 0; q < kT; ++q) hr[q] = _mm512_set1_ps(hs[q][r]);
    for (int v = 0; v < kS; ++v) {
      const __m512 w = lanes(row + v * kLanes, m[v]);
      for (int q = 0; q < kT; ++q) acc[q][v] = _mm512_fmadd_ps(hr[q], w, acc[q][v]);
    }
  }
  for (int q = 0; q < kT; ++q)
    for (int v = 0; v < kS; ++v)
      store(outs[q] + col + v * kLanes, m[v],
            _mm512_add_ps(lanes(ys[q] + col + v * kLanes, m[v]), acc[q][v]));
}
#else
template <typename W, typename Y, int kT>
void expand_strip(const W* b, const float* const* hs, const Y* const* ys, Y* const* outs,
                  int64_t rank, int64_t o_width, int64_t o0, int64_t o1, int64_t col) {
  const int64_t w = o1 - o0;
  float acc[kT][kStrip] = {};
  for (int64_t r = 0; r < rank; ++r) {
    const W* row = b + r * o_width + o0;
    for (int q = 0; q < kT; ++q)
      for (int64_t l = 0; l < w; ++l) acc[q][l] = fma(hs[q][r], widen(row[l]), acc[q][l]);
  }
  for (int q = 0; q < kT; ++q)
    for (int64_t l = 0; l < w; ++l) narrow(widen(ys[q][col + l]) + acc[q][l], outs[q] + col + l);
}
#endif

// One job: kT tokens of slot j (ids[0..kT)), shrink then expand. Its h stays in the
// worker's cache and the slot's a and b are read once for the kT tokens, straight through
// (a job streams its slot's weights in memory order: with many adapters, one token each,
// the call is a stream of the adapters' bytes).
template <typename W, typename Y, int kT>
void run_job(const Call& c, int64_t j, const int64_t* ids, float* h) {
  const W* a = static_cast<const W*>(c.a) + j * c.kr * c.in;
  const float* xs[kT];
  for (int q = 0; q < kT; ++q) xs[q] = c.x + ids[q] * c.in;
  for (int64_t r = 0; r < c.kr; ++r) {
    const W* row = a + r * c.in;
#ifdef __AVX512F__
    for (int64_t line = 0; line < c.in * int64_t(sizeof(W)); line += 64)  // 2 rows ahead
      _mm_prefetch(reinterpret_cast<const char*>(row + 2 * c.in) + line, _MM_HINT_T0);
#endif
    float s[kT];
    dots<W, kT>(row, xs, c.in, s);
    for (int q = 0; q < kT; ++q) h[q * c.kr + r] = s[q];
  }
  const float* hs[kT];
  const Y* ys[kT];
  Y* outs[kT];
  for (int q = 0; q < kT; ++q) {
    ys[q] = static_cast<const Y*>(c.y) + ids[q] * c.width;
    outs[q] = static_cast<Y*>(c.out) + ids[q] * c.width;
  }
  for (int64_t tg = 0; tg < c.k; ++tg) {
    const W* b = static_cast<const W*>(c.b[tg]) + j * c.rank * c.o[tg];
    for (int q = 0; q < kT; ++q) hs[q] = h + q * c.kr + tg * c.rank;
    for (int64_t o0 = 0; o0 < c.o[tg]; o0 += kStrip)
      expand_strip<W, Y, kT>(b, hs, ys, outs, c.rank, c.o[tg], o0,
                             std::min(o0 + kStrip, c.o[tg]), c.off[tg] + o0);
  }
}

// Job p: the p-th run of up to kTok tokens of one slot (jobs[p] = its first index in ids).
template <typename W, typename Y>
void run_job(const Call& c, int64_t p, std::vector<float>& h) {
  const int64_t i = c.jobs[p], j = c.slots[c.ids[i]];
  const int tokens = static_cast<int>(std::min<int64_t>(kTok, c.starts[j + 1] - i));
  h.resize(kTok * c.kr);
  switch (tokens) {
    case 4: run_job<W, Y, 4>(c, j, &c.ids[i], h.data()); break;
    case 3: run_job<W, Y, 3>(c, j, &c.ids[i], h.data()); break;
    case 2: run_job<W, Y, 2>(c, j, &c.ids[i], h.data()); break;
    default: run_job<W, Y, 1>(c, j, &c.ids[i], h.data());
  }
}

// The rows of tokens of no slot: y as it is (a copy unless y's buffer is the output's).
void keep_rows(Call& c, int64_t bytes) {
  if (c.out == c.y) return;
  for (int64_t i = 0; i < c.t; ++i)
    if (c.slots[i] < 0 || c.slots[i] >= c.n)
      std::memcpy(static_cast<char*>(c.out) + i * c.width * bytes,
                  static_cast<const char*>(c.y) + i * c.width * bytes, c.width * bytes);
}

// One parallel region a call: jobs taken from a shared counter, each a slot's tokens end
// to end, so the expand waits for no other thread's shrink.
template <typename W, typename Y>
void run(ffi::ThreadPool& pool, Call& c) {
  group(c.slots, c.t, c.n, c.ids, c.starts);
  keep_rows(c, sizeof(Y));
  c.jobs.clear();
  for (int64_t j = 0; j < c.n; ++j)
    for (int64_t i = c.starts[j]; i < c.starts[j + 1]; i += kTok) c.jobs.push_back(i);
  const int64_t m = static_cast<int64_t>(c.ids.size()), jobs = c.jobs.size();
  const int64_t parts = std::min(jobs, parts_for(pool, m * (c.kr * c.in + c.width * c.rank)));
  in_parts(pool, parts, [&c, parts, jobs](int64_t p) {
    thread_local std::vector<float> h;
    for (int64_t q = jobs * p / parts; q < jobs * (p + 1) / parts; ++q) run_job<W, Y>(c, q, h);
  });
}

bool is_float(ffi::DataType d) { return d == ffi::DataType::F32 || d == ffi::DataType::BF16; }

constexpr const char* kShapes =
    "lora add: expected x [T, I] and y [T, O] (float32 or bfloat16, the output as y), slots "
    "[T] int32, a [N, kR, I] and 1 to 4 b_i [N, R, O_i] (all float32 or all bfloat16) with "
    "kR = k R and O = the O_i's sum";

ffi::Error lora_add(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer y,
                    ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer a, ffi::RemainingArgs bs,
                    ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), yd = y.dimensions(), ad = a.dimensions();
  Call c;
  c.k = static_cast<int64_t>(bs.size());
  if (xd.size() != 2 || yd.size() != 2 || ad.size() != 3 || slots.dimensions().size() != 1 ||
      slots.dimensions()[0] != xd[0] || yd[0] != xd[0] || ad[2] != xd[1] || c.k < 1 ||
      c.k > kMaxTargets || ad[1] % c.k != 0 || !is_float(x.element_type()) ||
      !is_float(a.element_type()) || y.element_type() != out->element_type() ||
      !is_float(y.element_type()) || out->dimensions().size() != 2 ||
      out->dimensions()[0] != yd[0] || out->dimensions()[1] != yd[1])
    return ffi::Error::InvalidArgument(kShapes);
  c.t = xd[0], c.in = xd[1], c.n = ad[0], c.kr = ad[1], c.rank = ad[1] / c.k, c.width = yd[1];
  int64_t off = 0;
  for (int64_t i = 0; i < c.k; ++i) {
    auto b = bs.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument(kShapes);
    auto bd = b->dimensions();
    if (bd.size() != 3 || bd[0] != c.n || bd[1] != c.rank || b->element_type() != a.element_type())
      return ffi::Error::InvalidArgument(kShapes);
    c.b[i] = b->untyped_data(), c.o[i] = bd[2], c.off[i] = off, off += bd[2];
  }
  if (off != c.width) return ffi::Error::InvalidArgument(kShapes);
  std::vector<float> xf;
  if (x.element_type() == ffi::DataType::BF16) {  // widened once: the dots read float32 rows
    const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
    xf.resize(c.t * c.in);
    for (int64_t i = 0; i < c.t * c.in; ++i) xf[i] = widen(xb[i]);
  }
  c.x = xf.empty() ? static_cast<const float*>(x.untyped_data()) : xf.data();
  c.y = y.untyped_data(), c.out = out->untyped_data(), c.a = a.untyped_data();
  c.slots = slots.typed_data();
  const bool w16 = a.element_type() == ffi::DataType::BF16;
  const bool y16 = y.element_type() == ffi::DataType::BF16;
  if (w16 && y16) run<uint16_t, uint16_t>(pool, c);
  else if (w16) run<uint16_t, float>(pool, c);
  else if (y16) run<float, uint16_t>(pool, c);
  else run<float, float>(pool, c);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraAdd, lora_add,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [T, I]
                                  .Arg<ffi::AnyBuffer>()         // y [T, O]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Arg<ffi::AnyBuffer>()         // a [N, kR, I]
                                  .RemainingArgs()               // b_1 .. b_k [N, R, O_i]
                                  .Ret<ffi::AnyBuffer>());       // y + delta [T, O]
