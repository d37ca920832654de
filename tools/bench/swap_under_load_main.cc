// Live-weights benchmark: C callers score N-row requests against one model
// continuously while a pusher uploads a new version every few seconds. Every
// answer's bits are kept per (version, row); afterwards each row is scored
// alone, pinned to each version that answered, and must give the same bits.
// Reports rows/s before and during the swaps, each upload's time from its
// first byte to ready, failed calls and mismatched answers.
//
//   swap_under_load --target=127.0.0.1:50051 --model=policy --callers=64
//       --rows=256 --steady_seconds=10 --swap_seconds=60 --swap_every_seconds=2
//
// The server needs --max_versions_per_model above the number of pushes (the
// solo check needs every version), and H, V given by --hidden_size and
// --vocab_size.
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "tools/bench/closed_loop_caller.h"
#include "kernels/bfloat16.h"
#include "kernels/random_normal.h"
#include "digests/lm_head_digest.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address.");
ABSL_FLAG(std::string, model, "policy", "Model to push and score.");
ABSL_FLAG(int64_t, hidden_size, 4096, "H of the pushed versions.");
ABSL_FLAG(int64_t, vocab_size, 151936, "V of the pushed versions.");
ABSL_FLAG(int, callers, 64, "Concurrent callers, one call in flight each.");
ABSL_FLAG(int, channels, 16, "Distinct connections.");
ABSL_FLAG(int, rows, 256, "Rows per request.");
ABSL_FLAG(int, payloads, 8, "Distinct request payloads (the probe rows).");
ABSL_FLAG(double, steady_seconds, 10, "Load without swaps, measured.");
ABSL_FLAG(double, swap_seconds, 60, "Load with swaps, measured.");
ABSL_FLAG(double, swap_every_seconds, 2, "A new version this often.");
ABSL_FLAG(int, chunk_mib, 4, "Upload chunk size.");
ABSL_FLAG(bool, solo_check, true,
          "Afterwards, score every row alone pinned to every version that "
          "answered (needs them all still loaded).");

namespace {

using detlogp::client::LogpClient;
using detlogp::v1::LogProbRequest;
using detlogp::v1::LogProbResponse;

// A version's weight: a shared random base with rows r = k (mod 97) shifted,
// so each version has its own digest at little cost.
class VersionWeights {
 public:
  VersionWeights(int64_t hidden, int64_t vocab)
      : hidden_(hidden), vocab_(vocab) {
    base_.resize(hidden * vocab);
    const int threads = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (int64_t row = t; row < vocab; row += threads) {
          detlogp::kernels::RandomNormal random(77 + row);
          for (int64_t h = 0; h < hidden; ++h) {
            base_[row * hidden + h] =
                detlogp::kernels::FloatToBf16(random.Next(0.02f));
          }
        }
      });
    }
    for (auto& thread : pool) thread.join();
    current_ = base_;
  }

  // Makes the weight of push `k` (k >= 1) current.
  void Select(int k) {
    for (int64_t row = 0; row < vocab_; ++row) {
      uint16_t* dst = &current_[row * hidden_];
      const uint16_t* src = &base_[row * hidden_];
      if (row % 97 == k % 97) {
        for (int64_t h = 0; h < hidden_; ++h) {
          dst[h] = detlogp::kernels::FloatToBf16(
              detlogp::kernels::Bf16ToFloat(src[h]) + 0.001f * (k % 13 + 1));
        }
      } else if (row % 97 == (k - 1) % 97) {
        std::memcpy(dst, src, hidden_ * 2);
      }
    }
  }
  const std::vector<uint16_t>& current() const { return current_; }

 private:
  const int64_t hidden_, vocab_;
  std::vector<uint16_t> base_, current_;
};

struct PushRecord {
  int64_t version = 0;
  double seconds = 0;  // first byte sent to ready
  bool ok = false;
};

// Uploads the current weight as the model's next version; the time counts
// from the call (hashing included) to the answer.
PushRecord Push(detlogp::v1::ModelRepositoryService::Stub* stub,
                const std::string& model, const VersionWeights& weights,
                int64_t hidden, int64_t vocab, size_t chunk_bytes) {
  PushRecord record;
  grpc::ClientContext context;
  detlogp::v1::ModelVersionStatus status;
  const absl::Time start = absl::Now();
  auto writer = stub->UploadModel(&context, &status);
  detlogp::v1::UploadModelRequest message;
  auto* header = message.mutable_header();
  header->set_model(model);
  header->set_dtype(detlogp::v1::DTYPE_BFLOAT16);
  header->add_shape(vocab);
  header->add_shape(hidden);
  header->set_vocab_size(vocab);
  header->set_weights_sha256(detlogp::digests::ComputeLmHeadDigest(
      {hidden, vocab, vocab, false}, weights.current().data(), nullptr));
  writer->Write(message);
  const char* bytes = reinterpret_cast<const char*>(weights.current().data());
  const size_t total = weights.current().size() * 2;
  for (size_t offset = 0; offset < total; offset += chunk_bytes) {
    const size_t size = std::min(chunk_bytes, total - offset);
    message.set_chunk(bytes + offset, size);
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  const grpc::Status done = writer->Finish();
  record.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  record.ok = done.ok();
  record.version = status.version();
  if (!done.ok()) {
    std::fprintf(stderr, "upload failed: %s\n", done.error_message().c_str());
  }
  return record;
}

struct Shared {
  std::vector<std::unique_ptr<LogpClient>> clients;
  std::vector<LogProbRequest> payloads;
  absl::Time steady_from, swaps_from, stop_at;
  std::atomic<int64_t> steady_rows{0}, swap_rows{0};
  std::atomic<int64_t> calls{0}, errors{0}, mismatches{0};
  std::atomic<int> callers_left{0};
  absl::Notification all_done;
  absl::Mutex mu;
  // First bits seen per (version, payload), one float per row.
  std::map<std::pair<int64_t, int>, std::vector<float>> seen
      ABSL_GUARDED_BY(mu);
};

// Keeps the first bits of every (version, payload) and counts answers that
// differ from them, and rows per phase.
void Record(Shared* shared,
            const detlogp::bench::ClosedLoopCaller::Answer& answer) {
  ++shared->calls;
  if (!answer.status.ok()) {
    ++shared->errors;
    std::fprintf(stderr, "call failed: %s\n",
                 answer.status.error_message().c_str());
    return;
  }
  const auto& logprobs = answer.response.logprobs();
  std::vector<float> got(logprobs.begin(), logprobs.end());
  {
    absl::MutexLock lock(&shared->mu);
    auto [it, inserted] = shared->seen.try_emplace(
        {answer.response.model_version(), static_cast<int>(answer.payload)},
        got);
    if (!inserted &&
        std::memcmp(it->second.data(), got.data(), got.size() * 4) != 0) {
      ++shared->mismatches;
    }
  }
  const absl::Time now = answer.finished;
  if (now >= shared->swaps_from && now < shared->stop_at) {
    shared->swap_rows += static_cast<int64_t>(got.size());
  } else if (now >= shared->steady_from && now < shared->swaps_from) {
    shared->steady_rows += static_cast<int64_t>(got.size());
  }
}

// Scores every row of every payload alone, pinned to `version`; returns the
// rows whose bits differ from `seen`.
int64_t SoloMismatches(Shared& shared, int64_t version, int payload,
                       const std::vector<float>& seen, const std::string& model,
                       int64_t hidden) {
  const LogProbRequest& batch = shared.payloads[payload];
  std::atomic<int64_t> bad{0};
  std::vector<std::thread> threads;
  const int workers = 16;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      LogpClient& client = *shared.clients[w % shared.clients.size()];
      for (int r = w; r < batch.target_ids_size(); r += workers) {
        LogProbRequest solo = detlogp::client::MakeLogProbRequest(
            "solo", detlogp::v1::DTYPE_BFLOAT16, 1, hidden,
            batch.hidden().data().substr(r * hidden * 2, hidden * 2),
            {batch.target_ids(r)}, 1.0f, false);
        solo.set_model(model);
        solo.set_model_version(version);
        auto result = client.Score(solo);
        if (!result.ok() || result->logprobs.size() != 1 ||
            std::memcmp(&result->logprobs[0], &seen[r], 4) != 0) {
          ++bad;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model);
  const int64_t hidden = absl::GetFlag(FLAGS_hidden_size);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab_size);
  Shared shared;
  for (int c = 0; c < absl::GetFlag(FLAGS_channels); ++c) {
    LogpClient::Options options;
    options.target = absl::GetFlag(FLAGS_target);
    options.own_connection = true;
    shared.clients.push_back(*LogpClient::Create(options));
  }
  auto channel = grpc::CreateChannel(absl::GetFlag(FLAGS_target),
                                     grpc::InsecureChannelCredentials());
  auto repository = detlogp::v1::ModelRepositoryService::NewStub(channel);
  const size_t chunk_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_mib))
                             << 20;

  const absl::Time generate_start = absl::Now();
  VersionWeights weights(hidden, vocab);
  std::fprintf(stderr, "generated %.2f GB of weights in %.1f s\n",
               hidden * vocab * 2 / 1e9,
               absl::ToDoubleSeconds(absl::Now() - generate_start));
  std::vector<PushRecord> pushes;
  weights.Select(1);
  pushes.push_back(
      Push(repository.get(), model, weights, hidden, vocab, chunk_bytes));
  if (!pushes.back().ok) return 1;

  const int rows = absl::GetFlag(FLAGS_rows);
  for (int p = 0; p < absl::GetFlag(FLAGS_payloads); ++p) {
    LogProbRequest request = detlogp::client::MakeLogProbRequest(
        absl::StrCat("swap-", p), detlogp::v1::DTYPE_BFLOAT16, rows, hidden,
        detlogp::client::RandomBf16Rows(rows, hidden, 1000 + p),
        detlogp::client::RandomTargets(rows, vocab, 2000 + p), 1.0f, false);
    request.set_model(model);
    shared.payloads.push_back(std::move(request));
  }
  const double steady = absl::GetFlag(FLAGS_steady_seconds);
  const double swaps = absl::GetFlag(FLAGS_swap_seconds);
  shared.steady_from = absl::Now() + absl::Seconds(2);  // warm-up
  shared.swaps_from = shared.steady_from + absl::Seconds(steady);
  shared.stop_at = shared.swaps_from + absl::Seconds(swaps);
  const int callers = absl::GetFlag(FLAGS_callers);
  shared.callers_left = callers;
  std::vector<std::unique_ptr<detlogp::bench::ClosedLoopCaller>> all;
  for (int c = 0; c < callers; ++c) {
    all.push_back(std::make_unique<detlogp::bench::ClosedLoopCaller>(
        shared.clients[c % shared.clients.size()].get(), &shared.payloads, c,
        shared.stop_at,
        [&shared](const auto& answer) { Record(&shared, answer); },
        [&shared] {
          if (--shared.callers_left == 0) shared.all_done.Notify();
        }));
  }
  for (auto& caller : all) caller->Start();

  absl::SleepFor(shared.swaps_from - absl::Now());
  const absl::Duration every =
      absl::Seconds(absl::GetFlag(FLAGS_swap_every_seconds));
  for (int k = 2; absl::Now() + every <= shared.stop_at; ++k) {
    const absl::Time next = absl::Now() + every;
    weights.Select(k);
    pushes.push_back(
        Push(repository.get(), model, weights, hidden, vocab, chunk_bytes));
    absl::SleepFor(next - absl::Now());
  }
  shared.all_done.WaitForNotification();

  // Every row alone, pinned to each version that answered.
  int64_t solo_bad = 0, solo_rows = 0;
  std::map<std::pair<int64_t, int>, std::vector<float>> seen;
  {
    absl::MutexLock lock(&shared.mu);
    seen = shared.seen;
  }
  std::map<int64_t, int64_t> answers_per_version;
  for (const auto& [key, bits] : seen) {
    if (absl::GetFlag(FLAGS_solo_check)) {
      solo_bad +=
          SoloMismatches(shared, key.first, key.second, bits, model, hidden);
      solo_rows += static_cast<int64_t>(bits.size());
    }
    ++answers_per_version[key.first];
  }

  std::vector<double> push_seconds;
  int failed_pushes = 0;
  for (const PushRecord& push : pushes) {
    if (push.ok) push_seconds.push_back(push.seconds);
    failed_pushes += !push.ok;
  }
  std::sort(push_seconds.begin(), push_seconds.end());
  const double steady_rate = shared.steady_rows / steady;
  const double swap_rate = shared.swap_rows / swaps;
  std::printf(
      "{\"model\": \"%s\", \"callers\": %d, \"rows_per_request\": %d, "
      "\"pushes\": %zu, \"failed_pushes\": %d, \"push_s_min\": %.3f, "
      "\"push_s_median\": %.3f, \"push_s_max\": %.3f, \"versions_answering\": "
      "%zu, "
      "\"steady_rows_per_s\": %.0f, \"swap_rows_per_s\": %.0f, \"ratio\": "
      "%.3f, "
      "\"calls\": %lld, \"failed_calls\": %lld, \"answers_differing\": %lld, "
      "\"solo_rows_checked\": %lld, \"solo_rows_differing\": %lld}\n",
      model.c_str(), callers, rows, pushes.size(), failed_pushes,
      push_seconds.empty() ? 0 : push_seconds.front(),
      push_seconds.empty() ? 0 : push_seconds[push_seconds.size() / 2],
      push_seconds.empty() ? 0 : push_seconds.back(),
      answers_per_version.size(), steady_rate, swap_rate,
      steady_rate > 0 ? swap_rate / steady_rate : 0,
      static_cast<long long>(shared.calls.load()),
      static_cast<long long>(shared.errors.load()),
      static_cast<long long>(shared.mismatches.load()),
      static_cast<long long>(solo_rows), static_cast<long long>(solo_bad));
  const bool ok = failed_pushes == 0 && shared.errors == 0 &&
                  shared.mismatches == 0 && solo_bad == 0;
  return ok ? 0 : 1;
}
