// The large-call engine against an in-process server that answers each row
// with its own target id (so any row-order mistake shows), in any order, and
// refuses requests as a full queue would.
#include "client/call_engine.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "gtest/gtest.h"
#include "proto/status_details.h"

namespace detlogp::client {
namespace {

// logprobs[i] = target_ids[i]; refuses the first `refusals` requests with
// QUEUE_FULL (or every one with refuse_always); answers after a random
// delay; records the most rows it held at once.
class EchoService final : public v1::LogProbService::CallbackService {
 public:
  std::atomic<int> refusals{0};
  bool refuse_always = false;
  absl::Duration retry_delay = absl::Milliseconds(3);
  // Answers unpinned requests after the first `switch_after` with version 2.
  int switch_after = 1 << 30;
  // A request whose first target is this is refused naming target_ids[3].
  int64_t bad_first_target = -1;

  grpc::ServerUnaryReactor* ComputeLogProbs(
      grpc::CallbackServerContext* context, const v1::LogProbRequest* request,
      v1::LogProbResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const int64_t rows = request->target_ids_size();
    if (refuse_always || refusals.fetch_sub(1) > 0) {
      reactor->Finish(
          Refusal(v1::WithReason(absl::ResourceExhaustedError("queue full"),
                                 v1::kReasonQueueFull, {}, retry_delay)));
      return reactor;
    }
    if (rows > 0 && request->target_ids(0) == bad_first_target) {
      reactor->Finish(Refusal(v1::FieldError(absl::StatusCode::kInvalidArgument,
                                             "target_ids[3]", "bad")));
      return reactor;
    }
    {
      absl::MutexLock lock(&mu_);
      held_ += rows;
      most_held_ = std::max(most_held_, held_);
    }
    const int answered = answered_.fetch_add(1);
    std::thread([=] {
      absl::SleepFor(absl::Microseconds(std::hash<int>()(answered) % 3000));
      for (int64_t target : request->target_ids()) {
        response->add_logprobs(static_cast<float>(target));
      }
      response->set_determinism_key("dk1-test");
      response->set_model_version(request->model_version() != 0
                                      ? request->model_version()
                                      : (answered < switch_after ? 1 : 2));
      {
        absl::MutexLock lock(&mu_);
        held_ -= rows;
      }
      reactor->Finish(grpc::Status::OK);
    }).detach();
    return reactor;
  }

  int64_t most_held() {
    absl::MutexLock lock(&mu_);
    return most_held_;
  }

 private:
  static grpc::Status Refusal(const absl::Status& status) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                        std::string(status.message()),
                        v1::SerializeStatusDetails(status));
  }

  std::atomic<int> answered_{0};
  absl::Mutex mu_;
  int64_t held_ = 0;
  int64_t most_held_ = 0;
};

class CallEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    for (int i = 0; i < 4; ++i) {
      grpc::ChannelArguments arguments;
      arguments.SetInt("detlogp.connection", i);  // a connection each
      connections_.push_back(grpc::CreateCustomChannel(
          absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(),
          arguments));
    }
    options_.requests_in_flight_per_connection = 3;
    options_.prepare_context = [](grpc::ClientContext* context,
                                  absl::Time deadline) {
      context->set_deadline(absl::ToChronoTime(deadline));
    };
  }
  void TearDown() override { server_->Shutdown(); }

  // `count` requests of `rows` rows; row r of the call has target r.
  static std::vector<CallPart> Parts(int count, int rows) {
    std::vector<CallPart> parts;
    for (int p = 0; p < count; ++p) {
      CallPart part;
      for (int r = 0; r < rows; ++r) part.header.add_target_ids(p * rows + r);
      part.first_row = p * rows;
      parts.push_back(std::move(part));
    }
    return parts;
  }

  absl::StatusOr<std::vector<ScoreResult>> Send(
      std::vector<CallPart> parts, absl::Duration timeout = absl::Seconds(30)) {
    return SendCallParts(std::move(parts), connections_, window_, options_,
                         absl::Now() + timeout, &stats_);
  }

  static void ExpectRowsInOrder(const std::vector<ScoreResult>& answers,
                                int rows) {
    std::vector<float> joined;
    for (const ScoreResult& answer : answers) {
      joined.insert(joined.end(), answer.logprobs.begin(),
                    answer.logprobs.end());
    }
    ASSERT_EQ(static_cast<int>(joined.size()), rows);
    for (int r = 0; r < rows; ++r) ASSERT_EQ(joined[r], r) << "row " << r;
  }

  EchoService service_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::shared_ptr<grpc::Channel>> connections_;
  CallEngineOptions options_;
  RowWindow window_;
  CallStats stats_;
};

TEST_F(CallEngineTest, AnswersComeBackInRequestOrderWhateverOrderTheyArrive) {
  auto answers = Send(Parts(64, 16));
  ASSERT_TRUE(answers.ok()) << answers.status();
  ExpectRowsInOrder(*answers, 64 * 16);
  EXPECT_EQ(stats_.requests_sent, 64);
  EXPECT_EQ(window_.outstanding(), 0);
}

TEST_F(CallEngineTest, QueueFullRefusalsAreSentAgainAlone) {
  service_.refusals = 10;
  auto answers = Send(Parts(32, 8));
  ASSERT_TRUE(answers.ok()) << answers.status();
  ExpectRowsInOrder(*answers, 32 * 8);
  EXPECT_EQ(stats_.queue_full_retries, 10);
  EXPECT_EQ(stats_.requests_sent, 32 + 10);
}

TEST_F(CallEngineTest, AQueueFullUntilTheDeadlineIsDeadlineExceeded) {
  service_.refuse_always = true;
  service_.retry_delay = absl::Milliseconds(20);
  auto answers = Send(Parts(4, 8), absl::Milliseconds(150));
  ASSERT_EQ(answers.status().code(), absl::StatusCode::kDeadlineExceeded)
      << answers.status();
  EXPECT_NE(answers.status().message().find("0 of 32 rows answered"),
            std::string::npos)
      << answers.status();
  EXPECT_EQ(v1::DetailsOf(answers.status()).metadata.at("rows"), "32");
  EXPECT_EQ(window_.outstanding(), 0);
}

TEST_F(CallEngineTest, OutstandingRowsStayWithinTheWindow) {
  window_.SetCapacity(100);
  auto answers = Send(Parts(40, 30));
  ASSERT_TRUE(answers.ok()) << answers.status();
  ExpectRowsInOrder(*answers, 40 * 30);
  EXPECT_LE(service_.most_held(), 100);
  EXPECT_GT(service_.most_held(), 30);  // still side by side
}

TEST_F(CallEngineTest, TheFirstAnswersVersionIsTheWholeCallsVersion) {
  service_.switch_after = 5;  // unpinned requests after the 5th: version 2
  options_.requests_in_flight_per_connection = 1;
  auto answers = Send(Parts(24, 4));
  ASSERT_TRUE(answers.ok()) << answers.status();
  ExpectRowsInOrder(*answers, 24 * 4);
  for (const ScoreResult& answer : *answers) {
    EXPECT_EQ(answer.model_version, 1);
  }
}

TEST_F(CallEngineTest, AnotherErrorFailsTheCallNamingTheCallsRow) {
  service_.bad_first_target = 5 * 8;  // the sixth request, rows 40..47
  auto answers = Send(Parts(16, 8));
  ASSERT_EQ(answers.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v1::DetailsOf(answers.status()).fields,
            std::vector<std::string>{"target_ids[43]"});
  EXPECT_EQ(answers.status().message(), "target_ids[43]: bad");
  EXPECT_EQ(window_.outstanding(), 0);
}

}  // namespace
}  // namespace detlogp::client
