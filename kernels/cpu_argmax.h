// Each row's first largest entry, for greedy sampling (included by cpu_matmul.cc, which
// registers it beside the matmuls; kernels/cpu_matmul.py: row_argmax).
//
//   x [S, V] float32 -> [S] int32: the lowest index holding the row's maximum; a row holding
//   a NaN gives its first NaN (jnp.argmax's answer on both counts).
//
// Why a kernel: XLA:CPU's argmax is a variadic (value, index) reduction that runs one row at
// a time without vectors: 1.8 ms at 16 rows and 6.9 ms at 64 over SmolLM2's 49152-entry
// vocabulary (measured on a 2-core Xeon with AMX, beside a 1.8 ms bfloat16 LM head at 16
// rows; the kernel 0.1 and 0.33 ms). One vectorized pass over a row keeps each lane's maximum
// and where it first came; rows spread over the pool's threads.

typedef int32_t i8 __attribute__((vector_size(32)));

// One pass over a row: four lanes of 8 keep their largest value and where it first came
// (a strict > keeps the first of equals), and count NaNs (comparisons with NaN are false, so
// they are looked for apart, in a second pass that runs only when one is there).
int32_t first_argmax(const float* x, int64_t n) {
  const v8 lo = v8{} - INFINITY;
  v8 m[4] = {lo, lo, lo, lo};
  i8 at[4] = {}, nan = {};
  i8 cur[4];
  for (int a = 0; a < 4; ++a)
    for (int l = 0; l < 8; ++l) cur[a][l] = 8 * a + l;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int a = 0; a < 4; ++a) {
      const v8 v = load(x + i + 8 * a);
      const i8 gt = v > m[a];
      m[a] = gt ? v : m[a];
      at[a] = gt ? cur[a] : at[a];
      nan |= v != v;
      cur[a] += 32;
    }
  float best = -INFINITY;
  int64_t where = 0;
  bool any_nan = false;
  for (int a = 0; a < 4; ++a)
    for (int l = 0; l < 8; ++l) {
      if (m[a][l] > best || (m[a][l] == best && at[a][l] < where)) best = m[a][l], where = at[a][l];
      any_nan |= nan[l] != 0;
    }
  for (; i < n; ++i) {
    any_nan |= x[i] != x[i];
    if (x[i] > best) best = x[i], where = i;
  }
  if (any_nan)
    for (int64_t k = 0; k < n; ++k)
      if (x[k] != x[k]) return static_cast<int32_t>(k);
  return static_cast<int32_t>(where);  // all -inf (or empty): index 0, as jnp.argmax
}

// fn(r) for r in [0, count) over the pool's threads (cpu_tasks.h); a helper joins per
// `per_helper` rows (fewer are not worth waking it).
template <typename Fn>
void for_rows(ffi::ThreadPool& pool, int64_t count, int64_t per_helper, Fn fn) {
  for_tasks(pool, count, std::min<int64_t>(pool.num_threads(), count / per_helper), fn);
}

ffi::Error row_argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::S32> out) {
  auto d = x.dimensions();
  if (d.size() != 2 || out->dimensions().size() != 1 || out->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("row argmax: expected x [S, V] and out [S]");
  const int64_t n = d[1];
  const float* xs = x.typed_data();
  int32_t* ys = out->typed_data();
  // A row is about 10 us: helpers only where there are rows enough to share.
  for_rows(pool, d[0], 4, [=](int64_t r) { ys[r] = n ? first_argmax(xs + r * n, n) : 0; });
  return ffi::Error::Success();
}

// The argmax of a row whose `blocked` ids (min_tokens' EOS and stop ids, -1: none) count as
// -inf, as jnp.argmax answers for the row with them set to -inf: the plain pass first, and
// only when it lands on a blocked id (rare: the model wants to stop before min_tokens) a
// second pass that skips them. It spares the sampler writing -inf into a copy of the whole
// [S, V] logits (sample/sampler.py).
static bool in_list(int64_t i, const int32_t* ids, int64_t k) {
  for (int64_t b = 0; b < k; ++b)
    if (ids[b] == i) return true;
  return false;
}

static int32_t argmax_skipping(const float* x, int64_t n, const int32_t* ids, int64_t k) {
  int32_t got = first_argmax(x, n);
  if (!in_list(got, ids, k)) return got;
  float best = -INFINITY;
  int64_t where = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = in_list(i, ids, k) ? -INFINITY : x[i];
    if (v != v) return static_cast<int32_t>(i);  // a NaN: jnp.argmax's first NaN
    if (v > best) best = v, where = i;
  }
  return static_cast<int32_t>(where);
}

ffi::Error row_argmax_blocked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S32> blocked, ffi::ResultBuffer<ffi::S32> out) {
  auto d = x.dimensions();
  auto bd = blocked.dimensions();
  if (d.size() != 2 || bd.size() != 2 || bd[0] != d[0] || out->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument(
        "row argmax: expected x [S, V], blocked [S, B] and out [S]");
  const int64_t n = d[1], k = bd[1];
  const float* xs = x.typed_data();
  const int32_t* bs = blocked.typed_data();
  int32_t* ys = out->typed_data();
  for_rows(pool, d[0], 4, [=](int64_t r) {
    ys[r] = n ? argmax_skipping(xs + r * n, n, bs + r * k, k) : 0;
  });
  return ffi::Error::Success();
}
