// How fast the kernel maps fresh anonymous memory, block after block: each
// 256 MiB block is mapped with one madvise(MADV_POPULATE_WRITE), the way an
// upload maps its new weights, and kept until the end, so every block takes
// pages the process has not held before. Prints each block's wall and CPU
// seconds and its rate.
//
// On a virtual machine, pages the hypervisor has not backed cost several
// times more to map (the guest's page clearing waits on the host), and that
// time is the process's own CPU time. A server that first grows to its peak
// (the versions it keeps plus the one being uploaded) pays it.
//
// Usage: bazel run //tools/bench:first_touch -- [blocks, default 40]
#include <sys/mman.h>
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;
#endif

constexpr size_t kBlockBytes = size_t{256} << 20;

double Seconds(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 40;
  if (blocks < 1) {
    std::fprintf(stderr, "blocks must be >= 1, got %s\n", argv[1]);
    return 2;
  }
  std::vector<void*> held;
  for (int i = 0; i < blocks; ++i) {
    void* block = mmap(nullptr, kBlockBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) {
      std::perror("mmap");
      return 1;
    }
    held.push_back(block);
    const double wall = Seconds(CLOCK_MONOTONIC);
    const double cpu = Seconds(CLOCK_PROCESS_CPUTIME_ID);
    if (madvise(block, kBlockBytes, MADV_POPULATE_WRITE) != 0) {
      std::perror("madvise(MADV_POPULATE_WRITE)");
      return 1;
    }
    const double wall_s = Seconds(CLOCK_MONOTONIC) - wall;
    const double cpu_s = Seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu;
    std::printf(
        "block %d (%.2f GiB held): %.3f s wall, %.3f s CPU, %.2f GB/s\n", i,
        static_cast<double>(i + 1) * 0.25, wall_s, cpu_s,
        static_cast<double>(kBlockBytes) / wall_s / 1e9);
  }
  for (void* block : held) munmap(block, kBlockBytes);
  return 0;
}
