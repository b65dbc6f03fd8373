// A kernel call's work shared with the XLA pool's threads (included by cpu_attention.cc,
// cpu_lora.cc and cpu_matmul.cc after `namespace ffi = xla::ffi;`, inside their anonymous
// namespace). cpu_matmul.cc's own `run` keeps its loop: each of its workers sets up and
// releases AMX tile state once.

// Runs fn(i) for i in [0, count): the caller and up to `helpers` pool workers take indices
// from a shared counter; returns once every index is done. The counters are shared by
// pointer, so a worker that starts after the caller returned (every index taken) touches live
// memory and never calls fn: fn may capture the caller's locals by reference.
template <typename Fn>
void for_tasks(ffi::ThreadPool& pool, int64_t count, int64_t helpers, Fn fn) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto worker = [shared, count, fn]() {
    for (int64_t i; (i = shared->next.fetch_add(1)) < count;) {
      fn(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(worker)(worker));
  worker();
  while (shared->done.load(std::memory_order_acquire) < count) {
  }  // the last indices finish on other threads within microseconds
}
