#include "client/score_result.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"

namespace detlogp::client {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return detlogp::v1::StatusWithDetails(
      static_cast<absl::StatusCode>(status.error_code()),
      status.error_message(), status.error_details());
}

namespace {

// DATA_LOSS naming `field` unless it holds `want` values.
absl::Status CheckSize(absl::string_view field, int64_t got, int64_t want,
                       absl::string_view why) {
  if (got == want) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(field, ": the response holds ", got,
                                          " values, expected ", want, " (", why,
                                          ")"));
}

}  // namespace

absl::Status CheckLogProbResponse(
    const detlogp::v1::LogProbRequest& request,
    const detlogp::v1::LogProbResponse& response) {
  const int64_t rows = request.target_ids_size();
  const std::string per_row = absl::StrCat(rows, " rows");
  absl::Status status =
      CheckSize("logprobs", response.logprobs_size(), rows, per_row);
  if (status.ok()) {
    status =
        CheckSize("lse", response.lse_size(), request.return_lse() ? rows : 0,
                  request.return_lse() ? per_row : "return_lse not set");
  }
  if (status.ok()) {
    status = CheckSize(
        "entropy", response.entropy_size(), request.return_entropy() ? rows : 0,
        request.return_entropy() ? per_row : "return_entropy not set");
  }
  const int64_t k = std::max<int64_t>(request.top_k(), 0);
  const std::string per_top = k > 0 ? absl::StrCat(rows, " rows x top_k ", k)
                                    : std::string("top_k not set");
  if (status.ok()) {
    status = CheckSize("top_ids", response.top_ids_size(), rows * k, per_top);
  }
  if (status.ok()) {
    status = CheckSize("top_logprobs", response.top_logprobs_size(), rows * k,
                       per_top);
  }
  return status;
}

ScoreResult ToScoreResult(const detlogp::v1::LogProbResponse& response) {
  ScoreResult result;
  result.request_id = response.request_id();
  result.logprobs.assign(response.logprobs().begin(),
                         response.logprobs().end());
  result.lse.assign(response.lse().begin(), response.lse().end());
  result.entropy.assign(response.entropy().begin(), response.entropy().end());
  result.top_ids.assign(response.top_ids().begin(), response.top_ids().end());
  result.top_logprobs.assign(response.top_logprobs().begin(),
                             response.top_logprobs().end());
  if (!result.logprobs.empty()) {
    result.top_k =
        static_cast<int64_t>(result.top_ids.size() / result.logprobs.size());
  }
  result.determinism_key = response.determinism_key();
  result.model = response.model();
  result.model_version = response.model_version();
  result.server_timing = response.timing();
  return result;
}

absl::StatusOr<ScoreResult> ToScoreResult(
    const detlogp::v1::LogProbRequest& request,
    const detlogp::v1::LogProbResponse& response) {
  if (absl::Status status = CheckLogProbResponse(request, response);
      !status.ok()) {
    return status;
  }
  ScoreResult result = ToScoreResult(response);
  result.top_k = std::max<int64_t>(request.top_k(), 0);
  return result;
}

ScoreResult JoinScoreResults(std::vector<ScoreResult> parts) {
  ScoreResult joined = std::move(parts.front());
  joined.requests = static_cast<int64_t>(parts.size());
  detlogp::v1::ServerTiming& timing = joined.server_timing;
  for (size_t i = 1; i < parts.size(); ++i) {
    ScoreResult& part = parts[i];
    auto append = [](auto& to, const auto& from) {
      to.insert(to.end(), from.begin(), from.end());
    };
    append(joined.logprobs, part.logprobs);
    append(joined.lse, part.lse);
    append(joined.entropy, part.entropy);
    append(joined.top_ids, part.top_ids);
    append(joined.top_logprobs, part.top_logprobs);
    timing.set_validate_us(timing.validate_us() +
                           part.server_timing.validate_us());
    timing.set_queue_us(timing.queue_us() + part.server_timing.queue_us());
    timing.set_compute_us(timing.compute_us() +
                          part.server_timing.compute_us());
    timing.set_total_us(timing.total_us() + part.server_timing.total_us());
  }
  return joined;
}

}  // namespace detlogp::client
