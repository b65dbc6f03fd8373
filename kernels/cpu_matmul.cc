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
//     for each panel p in the run
//       for each 6 rows of the MC                          micro-kernel, 6 x 16 tile
//
// Written with GCC vector extensions, not intrinsics: the same source builds wherever g++
// does; on x86 with -march=native it compiles to AVX2 / AVX-512VL FMAs.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

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

void rows_block(int64_t mr, const float* x, int64_t K, const float* panel, float* y,
                int64_t ldy, int64_t cols) {
  switch (mr) {
    case 6: return micro<6>(x, K, panel, y, ldy, cols);
    case 5: return micro<5>(x, K, panel, y, ldy, cols);
    case 4: return micro<4>(x, K, panel, y, ldy, cols);
    case 3: return micro<3>(x, K, panel, y, ldy, cols);
    case 2: return micro<2>(x, K, panel, y, ldy, cols);
    default: return micro<1>(x, K, panel, y, ldy, cols);
  }
}

struct Problem {
  int64_t M, K, N, P;
  const float* x;
  const float* panels;
  float* y;
  int64_t panels_per_task, panel_tasks;
};

// Task t: rows [MC * (t / panel_tasks), ...) of x against a run of panels.
void run_task(const Problem& pb, int64_t t) {
  const int64_t m0 = kMC * (t / pb.panel_tasks);
  const int64_t p0 = pb.panels_per_task * (t % pb.panel_tasks);
  const int64_t m1 = std::min(pb.M, m0 + kMC), p1 = std::min(pb.P, p0 + pb.panels_per_task);
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = pb.panels + p * pb.K * kNR;
    const int64_t cols = std::min(kNR, pb.N - p * kNR);
    for (int64_t m = m0; m < m1; m += kMR)
      rows_block(std::min(kMR, m1 - m), pb.x + m * pb.K, pb.K, panel, pb.y + m * pb.N + p * kNR,
                 pb.N, cols);
  }
}

// The caller and up to num_threads - 1 pool workers take tasks from a shared counter (as in
// cpu_attention.cc); about four tasks per thread even out the threads' finishing times.
ffi::Error packed_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kNR || pd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] > pd[0] * kNR || yd[1] <= (pd[0] - 1) * kNR)
    return ffi::Error::InvalidArgument("packed matmul: expected x [M, K], panels "
                                       "[ceil(N / 16), K, 16] and y [M, N]");
  Problem pb{xd[0], xd[1], yd[1], pd[0], x.typed_data(), panels.typed_data(), y->typed_data(),
             0, 0};
  if (pb.M == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t row_tasks = (pb.M + kMC - 1) / kMC;
  const int64_t want = std::max<int64_t>(1, 4 * threads / row_tasks);
  pb.panels_per_task = (pb.P + want - 1) / want;
  pb.panel_tasks = (pb.P + pb.panels_per_task - 1) / pb.panels_per_task;
  const int64_t tasks = row_tasks * pb.panel_tasks;
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    Problem pb;
  };
  auto shared = std::make_shared<Shared>();
  shared->pb = pb;
  auto worker = [shared, tasks]() {
    for (int64_t t; (t = shared->next.fetch_add(1)) < tasks;) {
      run_task(shared->pb, t);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min(threads, tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(worker)(worker));
  worker();
  while (shared->done.load(std::memory_order_acquire) < tasks) {
  }  // the last tasks finish on other threads within microseconds
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmul, packed_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // panels [P, K, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
