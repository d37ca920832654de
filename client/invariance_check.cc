#include "client/invariance_check.h"

#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/logp_client.h"
#include "client/random_rows.h"

namespace detlogp::client {
namespace {

struct ProbeAnswer {
  float logprob = 0;
  float lse = 0;
  float entropy = 0;             // when options.entropy
  std::vector<int64_t> top_ids;  // options.top_k of them
  std::vector<float> top_logprobs;
};

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

// One mixed call: where each probe sits (or -1 for filler) and the request.
struct MixedCall {
  std::vector<int> probe_at_row;
  detlogp::v1::LogProbRequest request;
};

MixedCall MakeMixedCall(const std::string& probe_data,
                        const std::vector<int64_t>& probe_targets,
                        int64_t hidden_size, int64_t vocab_size,
                        const InvarianceOptions& options, std::mt19937_64& rng,
                        const std::string& id, const std::string& model,
                        int64_t model_version) {
  const int rows =
      std::uniform_int_distribution<int>(1, options.max_rows_per_call)(rng);
  const std::string filler = RandomBf16Rows(rows, hidden_size, rng());
  const std::vector<int64_t> filler_targets =
      RandomTargets(rows, vocab_size, rng());
  MixedCall call;
  std::string data;
  std::vector<int64_t> targets;
  const size_t row_bytes = hidden_size * 2;
  for (int r = 0; r < rows; ++r) {
    const bool probe = std::bernoulli_distribution(0.5)(rng);
    if (probe) {
      const int p = std::uniform_int_distribution<int>(
          0, static_cast<int>(probe_targets.size()) - 1)(rng);
      data.append(probe_data, p * row_bytes, row_bytes);
      targets.push_back(probe_targets[p]);
      call.probe_at_row.push_back(p);
    } else {
      data.append(filler, r * row_bytes, row_bytes);
      targets.push_back(filler_targets[r]);
      call.probe_at_row.push_back(-1);
    }
  }
  LogProbOptions request_options;
  request_options.temperature = options.temperature;
  request_options.return_lse = true;
  request_options.return_entropy =
      options.entropy && std::bernoulli_distribution(0.5)(rng);
  if (options.top_k > 0 && std::bernoulli_distribution(0.5)(rng)) {
    request_options.top_k =
        std::uniform_int_distribution<int64_t>(1, options.top_k)(rng);
  }
  request_options.model = model;
  request_options.model_version = model_version;
  call.request =
      MakeLogProbRequest(id, detlogp::v1::DTYPE_BFLOAT16, rows, hidden_size,
                         std::move(data), targets, request_options);
  return call;
}

}  // namespace

std::string InvarianceReport::Summary() const {
  return absl::StrCat(
      ok() ? "INVARIANT" : "NOT INVARIANT", ": ", probe_rows_checked,
      " probe rows checked in ", calls, " mixed calls (", stream_calls,
      " streamed; entropy checked on ", entropy_rows_checked, ", top-k on ",
      top_k_rows_checked, "), ", probe_rows_mismatched,
      " with different bits, ", failed_calls, " failed calls, key ",
      determinism_key, keys_consistent ? " (consistent)" : " (CHANGED)",
      first_error.empty() ? "" : absl::StrCat("; first error: ", first_error));
}

absl::StatusOr<InvarianceReport> CheckInvariance(
    const InvarianceOptions& options) {
  if (options.probes <= 0 || options.concurrency <= 0 ||
      options.channels <= 0 || options.max_rows_per_call <= 0) {
    return absl::InvalidArgumentError("invariance check: counts must be > 0");
  }
  if (options.top_k < 0) {
    return absl::InvalidArgumentError("invariance check: top_k must be >= 0");
  }
  std::vector<std::unique_ptr<LogpClient>> clients;
  for (int c = 0; c < options.channels; ++c) {
    LogpClient::Options client_options;
    client_options.target = options.target;
    client_options.own_connection = true;
    auto client = LogpClient::Create(client_options);
    if (!client.ok()) return client.status();
    clients.push_back(*std::move(client));
  }
  // Every call is pinned to the version resolved here, so a version
  // published meanwhile does not change the bits under the check.
  auto info = clients[0]->GetModelInfo(options.model, options.model_version);
  if (!info.ok()) return info.status();
  const std::string model = info->model();
  const int64_t model_version = info->model_version();
  const int64_t hidden_size = info->hidden_size();
  const int64_t vocab_size = info->vocab_size();

  InvarianceReport report;
  report.determinism_key = info->determinism_key();
  const std::string probe_data =
      RandomBf16Rows(options.probes, hidden_size, options.seed);
  const std::vector<int64_t> probe_targets =
      RandomTargets(options.probes, vocab_size, options.seed + 1);

  // Each probe alone (N = 1), with every output the mixed calls may ask for.
  LogProbOptions solo_options;
  solo_options.temperature = options.temperature;
  solo_options.return_lse = true;
  solo_options.return_entropy = options.entropy;
  solo_options.top_k = options.top_k;
  solo_options.model = model;
  solo_options.model_version = model_version;
  std::vector<ProbeAnswer> solo(options.probes);
  for (int p = 0; p < options.probes; ++p) {
    auto answer = clients[0]->Score(MakeLogProbRequest(
        absl::StrCat("solo-", p), detlogp::v1::DTYPE_BFLOAT16, 1, hidden_size,
        probe_data.substr(p * hidden_size * 2, hidden_size * 2),
        {probe_targets[p]}, solo_options));
    if (!answer.ok()) return answer.status();
    solo[p].logprob = answer->logprobs[0];
    solo[p].lse = answer->lse[0];
    if (options.entropy) solo[p].entropy = answer->entropy[0];
    solo[p].top_ids = std::move(answer->top_ids);
    solo[p].top_logprobs = std::move(answer->top_logprobs);
  }

  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < options.concurrency; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(options.seed * 1000003 + t);
      LogpClient& client = *clients[t % clients.size()];
      std::vector<MixedCall> calls;
      for (int i = 0; i < options.calls_per_thread; ++i) {
        calls.push_back(MakeMixedCall(
            probe_data, probe_targets, hidden_size, vocab_size, options, rng,
            absl::StrCat("mixed-", t, "-", i), model, model_version));
      }
      // Odd threads send their calls on one stream, even ones one by one.
      const bool streamed = t % 2 == 1;
      std::vector<absl::StatusOr<ScoreResult>> answers;
      if (streamed) {
        std::vector<detlogp::v1::LogProbRequest> requests;
        for (const MixedCall& call : calls) requests.push_back(call.request);
        auto results = client.ScoreStream(requests);
        for (size_t i = 0; i < calls.size(); ++i) {
          if (results.ok()) {
            answers.push_back((*results)[i]);
          } else {
            answers.push_back(results.status());
          }
        }
      } else {
        for (const MixedCall& call : calls)
          answers.push_back(client.Score(call.request));
      }
      absl::MutexLock lock(&mu);
      for (size_t i = 0; i < calls.size(); ++i) {
        if (!answers[i].ok()) {
          ++report.failed_calls;
          if (report.first_error.empty()) {
            report.first_error = answers[i].status().ToString();
          }
          continue;
        }
        ++report.calls;
        if (streamed) ++report.stream_calls;
        const ScoreResult& result = *answers[i];
        if (result.determinism_key != report.determinism_key ||
            result.request_id != calls[i].request.request_id()) {
          report.keys_consistent = false;
        }
        for (size_t r = 0; r < calls[i].probe_at_row.size(); ++r) {
          const int p = calls[i].probe_at_row[r];
          if (p < 0) continue;
          ++report.probe_rows_checked;
          bool same = SameBits(result.logprobs[r], solo[p].logprob) &&
                      SameBits(result.lse[r], solo[p].lse);
          if (!result.entropy.empty()) {
            ++report.entropy_rows_checked;
            same = same && SameBits(result.entropy[r], solo[p].entropy);
          }
          // The answer holds k = the request's top_k per row (checked by
          // the client); the solo list holds options.top_k >= k.
          const int64_t k = result.top_k;
          if (k > 0) {
            ++report.top_k_rows_checked;
            for (int64_t j = 0; j < k; ++j) {
              same = same && result.top_ids[r * k + j] == solo[p].top_ids[j] &&
                     SameBits(result.top_logprobs[r * k + j],
                              solo[p].top_logprobs[j]);
            }
          }
          if (!same) ++report.probe_rows_mismatched;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  return report;
}

}  // namespace detlogp::client
