// What one scoring call answers (ScoreResult), checked against what its
// request asked for, and the answers of a call's requests joined in row
// order.
#ifndef DETLOGP_CLIENT_SCORE_RESULT_H_
#define DETLOGP_CLIENT_SCORE_RESULT_H_

#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/status/statusor.h"
#include "detlogp/v1/detlogp.pb.h"

namespace detlogp::client {

struct ScoreResult {
  std::string request_id;
  std::vector<float> logprobs;
  std::vector<float> lse;  // empty unless asked for
  // Entropy of each row's softmax (nats), [N]; empty unless asked for.
  std::vector<float> entropy;
  // The k of top_ids / top_logprobs (the request's top_k; 0: not asked for).
  int64_t top_k = 0;
  // [N * top_k] row-major: row r's j-th most likely token is
  // top_ids[r * top_k + j] with log-prob top_logprobs[r * top_k + j]; each
  // row in descending log-prob order, ties to the lower token id.
  std::vector<int64_t> top_ids;
  std::vector<float> top_logprobs;
  std::string determinism_key;
  // The model and version every row was computed with.
  std::string model;
  int64_t model_version = 0;
  // Where the call's time went on the server, when the request set
  // return_timing (summed over the requests a large call was cut into).
  detlogp::v1::ServerTiming server_timing;
  // Requests the call took (more than one when it was cut to fit or spread
  // over connections), and the connections they went over.
  int64_t requests = 1;
  int connections = 1;
  // Requests the server refused for a full queue and the client sent again
  // after its retry delay.
  int64_t queue_full_retries = 0;
  // Requests sent again to another replica after theirs failed or went
  // away (Options::targets).
  int64_t replica_retries = 0;
  // Replicas that answered at least one of the call's requests.
  int replicas_answering = 1;
  // How the hidden rows travelled: "grpc" (in the messages), "system_shm"
  // or "cuda_shm" (the client's own region of that kind), "named_region"
  // (a region the request named).
  std::string path = "grpc";
  // The client's region path the call asked for and the server refused at
  // registration ("system_shm" or "cuda_shm"; the rows then took `path`),
  // on every call after the refusal; empty when none was refused.
  std::string path_refused;
  // Whether the hidden rows went through a shared-memory region (path is
  // not "grpc").
  bool used_shared_memory = false;
};

// Answers of consecutive slices of one request, joined in order (top_k of
// the first).
ScoreResult JoinScoreResults(std::vector<ScoreResult> parts);

// gRPC status to absl::Status, with the same code and message and the
// server's details (proto/status_details.h: DetailsOf reads them).
absl::Status FromGrpcStatus(const grpc::Status& status);

// OK when `response` has the sizes `request` asks for: N = target_ids
// logprobs; N lse when return_lse, else none; N entropy when return_entropy,
// else none; N * top_k top_ids and top_logprobs. Otherwise DATA_LOSS whose
// message starts with the field ("entropy: 3 values for 4 rows ...").
absl::Status CheckLogProbResponse(const detlogp::v1::LogProbRequest& request,
                                  const detlogp::v1::LogProbResponse& response);

// The response as a ScoreResult, checked against its request.
absl::StatusOr<ScoreResult> ToScoreResult(
    const detlogp::v1::LogProbRequest& request,
    const detlogp::v1::LogProbResponse& response);

// Unchecked: the response as it came. top_k is inferred as
// top_ids.size() / logprobs.size() (0 when there are no rows).
ScoreResult ToScoreResult(const detlogp::v1::LogProbResponse& response);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_SCORE_RESULT_H_
