// Times the H3 video projection CUDA kernels with CUDA events: median (and
// min) of --reps timed launches after warm-up, on fresh random data for each
// row count. Prints one line per (op, rows); --json writes them for
// tools/device/projection_bench.py, which adds the same-run PyTorch numbers.
//
//   projection_bench_main --rows=1,128,... --reps=25 --json=out.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/projection_cuda.h"
#include "kernels/projection.h"

namespace {

using detlogp::kernels::kProjectionInDim;
using detlogp::kernels::kProjectionOutDim;
using detlogp::kernels::ProjectionCuda;

#define CHECK_CUDA(expr)                                               \
  do {                                                                 \
    cudaError_t e_ = (expr);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

// Uniform [-1, 1) from a hash of (seed, index): fresh data, no zeros.
__global__ void FillRandom(float* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = scale * (static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

void Fill(float* p, int64_t n, uint64_t seed, float scale) {
  FillRandom<<<1024, 256>>>(p, n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
}

struct Timing {
  double median_ms, min_ms;
};

Timing Time(const std::function<void()>& fn, int reps) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    CHECK_CUDA(cudaEventElapsedTime(&ms[i], a, b));
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return {ms[reps / 2], ms[0]};
}

std::vector<int64_t> ParseRows(const std::string& s) {
  std::vector<int64_t> rows;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    rows.push_back(std::stoll(s.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  std::string rows_arg =
      "1,128,1024,4096,13104,37296,72576,102816,108576,364608";
  std::string json_path;
  int reps = 25;
  bool all_variants = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--rows=", 0) == 0) rows_arg = a.substr(7);
    if (a.rfind("--reps=", 0) == 0)
      reps = std::max(20, std::atoi(a.c_str() + 7));
    if (a.rfind("--json=", 0) == 0) json_path = a.substr(7);
    if (a == "--all-variants") all_variants = true;
  }
  const std::vector<int64_t> rows_list = ParseRows(rows_arg);
  const int64_t max_rows =
      *std::max_element(rows_list.begin(), rows_list.end());
  const int64_t K = kProjectionInDim, N = kProjectionOutDim;

  float *w, *b, *x, *y, *dy, *dx, *dw, *db;
  void* ws;
  // One workspace serves dX (chunk partials) and then dW (superchunk totals):
  // both run on one stream, one after the other.
  int64_t ws_bytes = ProjectionCuda::WeightGradWorkspaceBytes(max_rows, 0);
  for (int64_t r : rows_list) {
    ws_bytes = std::max(ws_bytes, ProjectionCuda::InputGradWorkspaceBytes(r));
  }
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  CHECK_CUDA(cudaMalloc(&dw, sizeof(float) * N * K));
  CHECK_CUDA(cudaMalloc(&db, sizeof(float) * N));
  CHECK_CUDA(cudaMalloc(&w, sizeof(float) * N * K));
  CHECK_CUDA(cudaMalloc(&b, sizeof(float) * N));
  CHECK_CUDA(cudaMalloc(&x, sizeof(float) * max_rows * K));
  CHECK_CUDA(cudaMalloc(&y, sizeof(float) * max_rows * N));
  CHECK_CUDA(cudaMalloc(&dy, sizeof(float) * max_rows * N));
  CHECK_CUDA(cudaMalloc(&dx, sizeof(float) * max_rows * K));
  Fill(w, N * K, 1, 0.1f);
  Fill(b, N, 2, 0.5f);

  struct Op {
    std::string name;
    std::unique_ptr<ProjectionCuda> proj;
  };
  std::vector<Op> ops;
  // --all-variants also times the variants kDefault never picks.
  std::vector<ProjectionCuda::ForwardVariant> variants = {
      ProjectionCuda::ForwardVariant::kDefault,
      ProjectionCuda::ForwardVariant::kSingleStage,
      ProjectionCuda::ForwardVariant::kWide};
  if (all_variants) {
    variants.push_back(ProjectionCuda::ForwardVariant::kDoubleBuffered);
    variants.push_back(ProjectionCuda::ForwardVariant::kSplitLoad);
  }
  for (auto v : variants) {
    ProjectionCuda::Options o;
    o.weight = w;
    o.bias = b;
    o.variant = v;
    auto p = ProjectionCuda::Create(o);
    if (!p.ok()) {
      std::fprintf(stderr, "Create: %s\n", p.status().ToString().c_str());
      return 1;
    }
    ops.push_back({v == ProjectionCuda::ForwardVariant::kDefault
                       ? std::string("fwd:default")
                       : std::string("fwd:") + (*p)->VariantName(),
                   std::move(*p)});
  }

  std::string json = "[\n";
  const auto& grad = ops[0].proj;
  std::printf("default forward kernel: %s\n", ProjectionCuda::KernelVersion());
  std::printf("grad kernels: %s\n", ProjectionCuda::GradKernelVersion());
  std::printf("%-58s %9s %10s %10s %8s\n", "op", "rows", "median_ms", "min_ms",
              "TFLOP/s");
  uint64_t seed = 100;
  for (int64_t rows : rows_list) {
    Fill(x, rows * K, ++seed, 1.f);
    Fill(dy, rows * N, ++seed, 1.f);
    const double flops = 2.0 * rows * K * N;
    auto emit = [&](const std::string& op, Timing t) {
      const double tflops = flops / (t.median_ms * 1e-3) / 1e12;
      std::printf("%-58s %9lld %10.4f %10.4f %8.2f\n", op.c_str(),
                  static_cast<long long>(rows), t.median_ms, t.min_ms, tflops);
      char buf[512];
      std::snprintf(buf, sizeof(buf),
                    "  {\"op\": \"%s\", \"rows\": %lld, \"median_ms\": %.5f, "
                    "\"min_ms\": %.5f, \"tflops\": %.3f},\n",
                    op.c_str(), static_cast<long long>(rows), t.median_ms,
                    t.min_ms, tflops);
      json += buf;
    };
    for (auto& op : ops) {
      emit(op.name, Time(
                        [&] {
                          auto st = op.proj->Forward(x, rows, y, nullptr);
                          if (!st.ok()) std::exit(2);
                        },
                        reps));
    }
    const Timing t_dx = Time(
        [&] {
          if (!grad->InputGrad(dy, rows, dx, ws, ws_bytes, nullptr).ok()) {
            std::exit(2);
          }
        },
        reps);
    emit("dx", t_dx);
    // Keys 0..rows-1; the workspace is part of our backward's extra memory.
    const Timing t_dw = Time(
        [&] {
          if (!grad->WeightGrad(dy, x, rows, 0, dw, db, ws, ws_bytes, nullptr)
                   .ok()) {
            std::exit(2);
          }
        },
        reps);
    emit("dw+db", t_dw);
    emit("bwd(dx+dw+db)",
         Time(
             [&] {
               if (!grad->InputGrad(dy, rows, dx, ws, ws_bytes, nullptr).ok()) {
                 std::exit(2);
               }
               if (!grad->WeightGrad(dy, x, rows, 0, dw, db, ws, ws_bytes,
                                     nullptr)
                        .ok()) {
                 std::exit(2);
               }
             },
             reps));
    std::printf("bwd extra memory (dx+dW+db+workspace) rows=%lld: %.1f MB\n",
                static_cast<long long>(rows),
                (rows * K + N * K + N) * 4.0 / (1 << 20) +
                    std::max(ProjectionCuda::WeightGradWorkspaceBytes(rows, 0),
                             ProjectionCuda::InputGradWorkspaceBytes(rows)) /
                        double(1 << 20));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  if (json.size() > 2) json.erase(json.size() - 2, 1);  // trailing comma
  json += "]\n";
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f != nullptr) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}
