// Google Benchmark for the CPU fused linear-logp: GFLOP/s counting 2*N*H*V,
// logp-only and with the extras: BM_LinearLogpCpu/N/H/V/extras
// with extras 0 = none, 1 = entropy, 2 = top_k 20, 3 = both.
//   bazel run -c opt //kernels:linear_logp_cpu_benchmark
#include <benchmark/benchmark.h>

#include <vector>

#include "kernels/bfloat16.h"
#include "kernels/linear_logp_cpu.h"
#include "kernels/random_normal.h"

namespace detlogp::kernels {
namespace {

void BM_LinearLogpCpu(benchmark::State& state) {
  const int64_t rows = state.range(0);
  const int64_t hidden_size = state.range(1);
  const int64_t vocab_size = state.range(2);
  RandomNormal random(state.range(0) * 7919 + 1);
  std::vector<uint16_t> weight(vocab_size * hidden_size);
  for (uint16_t& w : weight) w = FloatToBf16(random.Next(0.02f));
  std::vector<float> bias(vocab_size);
  for (float& b : bias) b = random.Next(0.1f);
  std::vector<uint16_t> hidden(rows * hidden_size);
  for (uint16_t& h : hidden) h = FloatToBf16(random.Next(1.0f));
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r)
    targets[r] = static_cast<int32_t>((r * 7717) % vocab_size);
  std::vector<float> temperatures(rows, 1.0f), logprobs(rows), lse(rows);
  const LmHeadView head{hidden_size, vocab_size, vocab_size, weight.data(),
                        bias.data()};
  LogpRowsView view{rows,
                    hidden.data(),
                    targets.data(),
                    temperatures.data(),
                    logprobs.data(),
                    lse.data()};
  const int64_t extras = state.range(3);
  constexpr int32_t kTopK = 20;
  std::vector<float> entropy(rows), top_logprobs(rows * kTopK);
  std::vector<int32_t> top_ids(rows * kTopK);
  if (extras & 1) view.entropy = entropy.data();
  if (extras & 2) {
    view.top_k = kTopK;
    view.top_ids = top_ids.data();
    view.top_logprobs = top_logprobs.data();
  }
  ThreadPool pool(0);
  for (auto _ : state) {
    benchmark::DoNotOptimize(ComputeLinearLogpCpu(head, view, &pool));
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * rows * hidden_size * vocab_size;
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["rows/s"] =
      benchmark::Counter(static_cast<double>(rows) * state.iterations(),
                         benchmark::Counter::kIsRate);
}

BENCHMARK(BM_LinearLogpCpu)
    ->ArgsProduct({{1, 16, 64, 256}, {1024}, {32000}, {0, 1, 2, 3}})
    ->ArgNames({"N", "H", "V", "extras"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace detlogp::kernels
