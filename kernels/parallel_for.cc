#include "kernels/parallel_for.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace detlogp::kernels {

void ParallelForRanges(int64_t n, int num_threads,
                       const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int64_t threads = num_threads > 0
                        ? num_threads
                        : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, n);
  if (threads == 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    pool.emplace_back(fn, n * t / threads, n * (t + 1) / threads);
  }
  fn(0, n / threads);
  for (auto& th : pool) th.join();
}

}  // namespace detlogp::kernels
