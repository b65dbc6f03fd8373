// Logprobs of the sampled rows, for requests that ask for them (included by cpu_matmul.cc,
// which registers it beside the matmuls; kernels/cpu_matmul.py: row_logprobs).
//
//   x [S, V] float32 raw logits, tokens [S] int32, active [S] int32 ->
//     chosen [S]: log_softmax(x[s])[tokens[s]];  rank [S]: 1 + #{v : x[s, v] > x[s, token]};
//     top_ids [S, J], top_lp [S, J]: the J largest entries (ties: the lower id first) and
//     their log_softmax;  rows with active[s] == 0 get zeros.
//
// Why a kernel: on XLA:CPU the same three passes over a row (max, sum of exponentials, top-J)
// ran one row per while-loop trip (sample/logprobs.py: gather_active), and in the routing
// probe (20 logprobs of Qwen's 152k vocabulary) they made a request 1.05-1.08x one asking
// none. Here two vectorized passes: the first keeps the maximum and the top J (a sorted list
// that an entry enters only above its last, J * ln(V / J) times for random logits), the
// second sums exp(x - max) and counts the entries above the token's.

typedef int32_t i8v __attribute__((vector_size(32)));

// exp(x) for x <= 0, about 1 ulp: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial of
// r, scaled by 2^n built in the exponent bits; below -87.3 (where exp leaves the normal
// floats) 0. Rounding n: t - 0.5 truncated is t rounded for t <= 0 (fast-math may not keep
// the usual add-and-subtract rounding trick).
static inline v8 exp_nonpositive(v8 x) {
  const v8 t = x * 1.44269504088896341f;
  const i8v n = __builtin_convertvector(t - 0.5f, i8v);
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  v8 p = r * (1.f / 5040) + (1.f / 720);
  p = p * r + (1.f / 120);
  p = p * r + (1.f / 24);
  p = p * r + (1.f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i8v bits = (n + 127) << 23;
  v8 scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  const i8v under = x < -87.3f;
  return under ? v8{} : p * scale;
}

// Pass 1: the row's maximum, and its top J into (vals, ids), best first.
static float max_and_top(const float* x, int64_t n, int64_t j, float* vals, int32_t* ids) {
  int64_t held = 0;
  float mx = -INFINITY, floor = -INFINITY;  // floor: the smallest held while the list is full
  auto offer = [&](float v, int64_t i) {
    if (held == j && !(v > floor)) return;
    int64_t at = held < j ? held++ : j - 1;
    while (at > 0 && vals[at - 1] < v) {  // equals stay ahead: they have the lower ids
      vals[at] = vals[at - 1], ids[at] = ids[at - 1];
      --at;
    }
    vals[at] = v, ids[at] = static_cast<int32_t>(i);
    if (held == j) floor = vals[j - 1];
  };
  v8 m = v8{} - INFINITY;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load(x + i);
    m = v > m ? v : m;
    if (j) {
      const i8v above = v > floor;
      bool any = false;
      for (int l = 0; l < 8; ++l) any |= above[l] != 0;
      if (any || held < j)
        for (int l = 0; l < 8; ++l) offer(v[l], i + l);
    }
  }
  for (int l = 0; l < 8; ++l) mx = m[l] > mx ? m[l] : mx;
  for (; i < n; ++i) {
    mx = x[i] > mx ? x[i] : mx;
    if (j) offer(x[i], i);
  }
  return mx;
}

// Pass 2: log of the sum of exp(x - mx), and how many entries exceed `picked`. The sum is
// kept in double (a float sum of 150k terms drifts by ~1e-5 relative: more than the logprobs'
// own rounding), in four chains of 8 lanes, added in a fixed order: the same row gives the
// same bits in any batch.
typedef double v4d __attribute__((vector_size(32)));

static inline void add_wide(v4d* acc, v8 e) {
  acc[0] += __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1, 2, 3), v4d);
  acc[1] += __builtin_convertvector(__builtin_shufflevector(e, e, 4, 5, 6, 7), v4d);
}

static float log_norm_and_rank(const float* x, int64_t n, float mx, float picked,
                               int32_t* above) {
  v4d acc[8] = {};
  i8v count = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int a = 0; a < 4; ++a) {
      const v8 v = load(x + i + 8 * a);
      add_wide(acc + 2 * a, exp_nonpositive(v - mx));
      count -= v > picked;  // a true lane is -1
    }
  double sum = 0.0;
  int32_t c = 0;
  for (int a = 0; a < 8; ++a)
    for (int l = 0; l < 4; ++l) sum += acc[a][l];
  for (int l = 0; l < 8; ++l) c += count[l];
  for (; i < n; ++i) {
    sum += std::exp(static_cast<double>(x[i] - mx));
    c += x[i] > picked;
  }
  *above = c;
  return static_cast<float>(std::log(sum));
}

ffi::Error row_logprobs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> active,
                        ffi::ResultBuffer<ffi::F32> chosen, ffi::ResultBuffer<ffi::S32> rank,
                        ffi::ResultBuffer<ffi::S32> top_ids,
                        ffi::ResultBuffer<ffi::F32> top_lp) {
  auto d = x.dimensions();
  if (d.size() != 2 || tokens.dimensions()[0] != d[0] || active.dimensions()[0] != d[0] ||
      top_ids->dimensions().size() != 2 || top_ids->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument(
        "row logprobs: expected x [S, V], tokens [S], active [S], top_ids [S, J]");
  const int64_t rows = d[0], n = d[1], j = top_ids->dimensions()[1];
  if (j > n) return ffi::Error::InvalidArgument("row logprobs: J exceeds the vocabulary");
  const float* xs = x.typed_data();
  const int32_t *tok = tokens.typed_data(), *act = active.typed_data();
  float *ch = chosen->typed_data(), *tl = top_lp->typed_data();
  int32_t *rk = rank->typed_data(), *ti = top_ids->typed_data();
  std::fill(ch, ch + rows, 0.f), std::fill(rk, rk + rows, 0);
  std::fill(tl, tl + rows * j, 0.f), std::fill(ti, ti + rows * j, 0);
  std::vector<int64_t> live;
  for (int64_t r = 0; r < rows; ++r)
    if (act[r] && tok[r] >= 0 && tok[r] < n) live.push_back(r);
  const int64_t count = static_cast<int64_t>(live.size());
  // A row of a 152k vocabulary is tens of us: a helper from two rows on.
  for_rows(pool, count, 2, [&](int64_t k) {
    const int64_t r = live[k];
    const float* row = xs + r * n;
    const float mx = max_and_top(row, n, j, tl + r * j, ti + r * j);
    int32_t above = 0;
    const float norm = log_norm_and_rank(row, n, mx, row[tok[r]], &above);
    ch[r] = (row[tok[r]] - mx) - norm;
    rk[r] = above + 1;
    for (int64_t q = 0; q < j; ++q) tl[r * j + q] = (tl[r * j + q] - mx) - norm;
  });
  return ffi::Error::Success();
}
