// A closed-loop load caller for the serving benchmarks: keeps one
// ComputeLogProbs call in flight until a stop time, issuing the next call
// from the previous one's callback and cycling through shared payloads from
// its own offset; every answer goes to a callback. With serialized payloads
// (the same requests' bytes, built once) calls go through gRPC's generic
// stub: the caller spends nothing on serialization, so a benchmark measures
// what the server receives rather than what one client thread can encode.
#ifndef DETLOGP_TOOLS_BENCH_CLOSED_LOOP_CALLER_H_
#define DETLOGP_TOOLS_BENCH_CLOSED_LOOP_CALLER_H_

#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "client/logp_client.h"

namespace detlogp::bench {

class ClosedLoopCaller {
 public:
  struct Answer {
    const grpc::Status& status;
    const detlogp::v1::LogProbResponse& response;
    size_t payload;  // index into the payloads
    absl::Time started, finished;
  };

  // `client` and `payloads` outlive the caller; `on_answer` runs on gRPC's
  // threads; `on_stopped` runs once, when the caller stops at `stop_at`.
  ClosedLoopCaller(client::LogpClient* client,
                   const std::vector<detlogp::v1::LogProbRequest>* payloads,
                   size_t offset, absl::Time stop_at,
                   std::function<void(const Answer&)> on_answer,
                   std::function<void()> on_stopped)
      : client_(client),
        payloads_(payloads),
        offset_(offset),
        stop_at_(stop_at),
        on_answer_(std::move(on_answer)),
        on_stopped_(std::move(on_stopped)) {}

  // Sends `serialized[i]` (payload i's bytes) instead of payload i; both
  // outlive the caller.
  void SendSerialized(const std::vector<grpc::ByteBuffer>* serialized) {
    serialized_ = serialized;
    generic_ = std::make_unique<grpc::GenericStub>(client_->channel());
  }

  void Start() { Issue(); }

 private:
  void Issue() {
    if (absl::Now() >= stop_at_) {
      on_stopped_();
      return;
    }
    context_ = std::make_unique<grpc::ClientContext>();
    response_.Clear();
    payload_ = (offset_ + calls_++) % payloads_->size();
    started_ = absl::Now();
    if (serialized_ != nullptr) {
      IssueSerialized();
      return;
    }
    client_->stub()->async()->ComputeLogProbs(
        context_.get(), &(*payloads_)[payload_], &response_,
        [this](grpc::Status status) {
          on_answer_({status, response_, payload_, started_, absl::Now()});
          Issue();
        });
  }

  void IssueSerialized() {
    client_->PrepareContext(context_.get());
    received_.Clear();
    generic_->UnaryCall(
        context_.get(), "/detlogp.v1.LogProbService/ComputeLogProbs",
        grpc::StubOptions(), &(*serialized_)[payload_], &received_,
        [this](grpc::Status status) {
          if (status.ok()) {
            grpc::ProtoBufferReader reader(&received_);
            if (!response_.ParseFromZeroCopyStream(&reader)) {
              status = grpc::Status(grpc::StatusCode::DATA_LOSS,
                                    "LogProbResponse does not parse");
            }
          }
          on_answer_({status, response_, payload_, started_, absl::Now()});
          Issue();
        });
  }

  client::LogpClient* const client_;
  const std::vector<detlogp::v1::LogProbRequest>* const payloads_;
  const size_t offset_;
  const absl::Time stop_at_;
  const std::function<void(const Answer&)> on_answer_;
  const std::function<void()> on_stopped_;
  size_t calls_ = 0;
  size_t payload_ = 0;
  absl::Time started_;
  std::unique_ptr<grpc::ClientContext> context_;
  detlogp::v1::LogProbResponse response_;
  const std::vector<grpc::ByteBuffer>* serialized_ = nullptr;
  std::unique_ptr<grpc::GenericStub> generic_;
  grpc::ByteBuffer received_;
};

}  // namespace detlogp::bench

#endif  // DETLOGP_TOOLS_BENCH_CLOSED_LOOP_CALLER_H_
