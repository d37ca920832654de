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
#include "absl/synchronization/notification.h"
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
  // Answers the first this many requests to arrive, then UNAVAILABLE to
  // every one (a replica going away); -1: never.
  int unavailable_after = -1;
  // The one version this replica holds (0: any): a request pinned to
  // another is refused with VERSION_UNAVAILABLE, an unpinned one answered
  // with it.
  int64_t holds_version = 0;
  // Requests after the first this many to arrive are held until cancelled (the
  // server shutting down cancels them); -1: none held. first_held is notified
  // when the first one arrives.
  int hold_after = -1;
  absl::Notification first_held;
  // Set when the request numbered retire_after arrives (the replica leaves
  // the client's set as it is being served); -1: never.
  int retire_after = -1;
  std::atomic<bool> retired{false};

  grpc::ServerUnaryReactor* ComputeLogProbs(
      grpc::CallbackServerContext* context, const v1::LogProbRequest* request,
      v1::LogProbResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const int64_t rows = request->target_ids_size();
    // Arrivals are numbered once, so "the first N" holds under any
    // interleaving.
    const int arrival = requests_.fetch_add(1);
    if (arrival == retire_after) retired = true;
    if (unavailable_after >= 0 && arrival >= unavailable_after) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone"));
      return reactor;
    }
    if (holds_version != 0 && request->model_version() != 0 &&
        request->model_version() != holds_version) {
      reactor->Finish(Refusal(
          v1::WithReason(absl::NotFoundError("model_version: not held here"),
                         v1::kReasonVersionUnavailable)));
      return reactor;
    }
    if (hold_after >= 0 && arrival >= hold_after) {
      // Arrivals are numbered once: one notification, however many are held.
      if (arrival == hold_after) first_held.Notify();
      return new HeldUntilCancelled();
    }
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
    rows_answered_.fetch_add(rows);
    std::thread([=] {
      absl::SleepFor(absl::Microseconds(std::hash<int>()(answered) % 3000));
      for (int64_t target : request->target_ids()) {
        response->add_logprobs(static_cast<float>(target));
      }
      response->set_determinism_key("dk1-test");
      int64_t version = answered < switch_after ? 1 : 2;
      if (holds_version != 0) version = holds_version;
      if (request->model_version() != 0) version = request->model_version();
      response->set_model_version(version);
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
  // Requests that arrived, and rows answered OK.
  int requests() const { return requests_.load(); }
  int64_t rows_answered() const { return rows_answered_.load(); }

 private:
  // A request never answered: finished only when the server cancels it.
  class HeldUntilCancelled final : public grpc::ServerUnaryReactor {
   public:
    void OnCancel() override {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "server stopping"));
    }
    void OnDone() override { delete this; }
  };

  static grpc::Status Refusal(const absl::Status& status) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                        std::string(status.message()),
                        v1::SerializeStatusDetails(status));
  }

  std::atomic<int> answered_{0};
  std::atomic<int> requests_{0};
  std::atomic<int64_t> rows_answered_{0};
  absl::Mutex mu_;
  int64_t held_ = 0;
  int64_t most_held_ = 0;
};

class CallEngineTest : public ::testing::Test {
 public:
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

  absl::StatusOr<std::vector<ScoreResult>> Send(
      std::vector<CallPart> parts, absl::Duration timeout = absl::Seconds(30)) {
    return SendCallParts(std::move(parts), connections_, window_, options_,
                         absl::Now() + timeout, &stats_);
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

// A replica: an echo server of its own, and the client's window and health
// of it.
struct EchoReplica {
  EchoService service;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<grpc::Channel> channel;
  RowWindow window;
  std::unique_ptr<ReplicaHealth> health;
  std::string target;
};

class ReplicasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.requests_in_flight_per_connection = 2;
    options_.prepare_context = [](grpc::ClientContext* context,
                                  absl::Time deadline) {
      context->set_deadline(absl::ToChronoTime(deadline));
    };
  }
  void TearDown() override {
    for (auto& replica : replicas_) {
      if (replica->server != nullptr) replica->server->Shutdown();
    }
  }

  // Starts `count` replicas; their services may be configured before Send.
  void StartReplicas(int count, ReplicaHealth::Options health = {}) {
    for (int r = 0; r < count; ++r) {
      auto replica = std::make_unique<EchoReplica>();
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                               &port);
      builder.RegisterService(&replica->service);
      replica->server = builder.BuildAndStart();
      ASSERT_NE(replica->server, nullptr);
      replica->target = absl::StrCat("127.0.0.1:", port);
      replica->channel = grpc::CreateChannel(
          replica->target, grpc::InsecureChannelCredentials());
      replica->health = std::make_unique<ReplicaHealth>(health);
      replicas_.push_back(std::move(replica));
    }
  }

  std::vector<CallReplica> CallReplicas() {
    std::vector<CallReplica> call;
    for (auto& replica : replicas_) {
      call.push_back(CallReplica{&replica->window,
                                 replica->health.get(),
                                 {replica->channel},
                                 replica->target,
                                 &replica->service.retired});
    }
    return call;
  }

  absl::StatusOr<std::vector<ScoreResult>> Send(
      std::vector<CallPart> parts, absl::Duration timeout = absl::Seconds(30)) {
    return SendCallParts(std::move(parts), CallReplicas(), options_,
                         absl::Now() + timeout, &stats_);
  }

  int64_t RowsAnsweredByServers() const {
    int64_t rows = 0;
    for (const auto& replica : replicas_) {
      rows += replica->service.rows_answered();
    }
    return rows;
  }

  std::vector<std::unique_ptr<EchoReplica>> replicas_;
  CallEngineOptions options_;
  CallStats stats_;
};

TEST_F(ReplicasTest, ACallIsSpreadOverEveryReplicaAndComesBackInOrder) {
  StartReplicas(3);
  auto answers = Send(CallEngineTest::Parts(60, 16));
  ASSERT_TRUE(answers.ok()) << answers.status();
  CallEngineTest::ExpectRowsInOrder(*answers, 60 * 16);
  ASSERT_EQ(stats_.answered_by.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_GT(stats_.answered_by[r], 0) << "replica " << r;
    EXPECT_EQ(replicas_[r]->window.outstanding(), 0);
  }
  EXPECT_EQ(
      stats_.answered_by[0] + stats_.answered_by[1] + stats_.answered_by[2],
      60);
  EXPECT_EQ(RowsAnsweredByServers(), 60 * 16);
}

TEST_F(ReplicasTest, AnUnavailableReplicasRequestsGoToTheOthers) {
  StartReplicas(3);
  replicas_[1]->service.unavailable_after = 2;
  auto answers = Send(CallEngineTest::Parts(48, 8));
  ASSERT_TRUE(answers.ok()) << answers.status();
  CallEngineTest::ExpectRowsInOrder(*answers, 48 * 8);
  EXPECT_GT(stats_.replica_retries, 0);
  EXPECT_LE(stats_.answered_by[1], 2);
  EXPECT_FALSE(replicas_[1]->health->up());
  // Every row answered once, by one server.
  EXPECT_EQ(RowsAnsweredByServers(), 48 * 8);
}

// A replica that leaves the set mid-call (its address left DNS) drains:
// the requests it holds are answered there, and it gets no new one.
TEST_F(ReplicasTest, AReplicaRetiredMidCallFinishesItsRequestsAndTakesNoMore) {
  StartReplicas(3);
  replicas_[1]->service.retire_after = 1;
  auto answers = Send(CallEngineTest::Parts(60, 8));
  ASSERT_TRUE(answers.ok()) << answers.status();
  CallEngineTest::ExpectRowsInOrder(*answers, 60 * 8);
  EXPECT_EQ(stats_.replica_retries, 0);
  // Two arrived before it retired, and one more may have been sent while
  // the second was on its way (two in flight per connection).
  EXPECT_GE(stats_.answered_by[1], 2);
  EXPECT_LE(stats_.answered_by[1], 3);
  EXPECT_TRUE(replicas_[1]->health->up());
  EXPECT_EQ(RowsAnsweredByServers(), 60 * 8);
}

TEST_F(ReplicasTest, AReplicaShutDownMidCallLosesNoRow) {
  StartReplicas(3);
  EchoReplica& dying = *replicas_[2];
  dying.service.hold_after = 3;
  absl::StatusOr<std::vector<ScoreResult>> answers;
  std::thread call([&] { answers = Send(CallEngineTest::Parts(64, 8)); });
  // Held requests are in flight at it; stopping the server cancels them
  // and refuses its connections from then on.
  dying.service.first_held.WaitForNotification();
  dying.server->Shutdown(std::chrono::system_clock::now());
  call.join();
  ASSERT_TRUE(answers.ok()) << answers.status();
  CallEngineTest::ExpectRowsInOrder(*answers, 64 * 8);
  EXPECT_GT(stats_.replica_retries, 0);
  // It answered 3 requests before it held; an answer sent as it stopped may
  // be lost on the way, and its request is then answered again elsewhere
  // (the call still takes each row once).
  EXPECT_LE(stats_.answered_by[2], 3);
  EXPECT_EQ(RowsAnsweredByServers(), 64 * 8 + 8 * (3 - stats_.answered_by[2]));
}

TEST_F(ReplicasTest, ADownReplicaTakesNoRequestUntilItsBackoffPassed) {
  ReplicaHealth::Options health;
  health.first_backoff = absl::Hours(1);
  StartReplicas(2, health);
  replicas_[0]->service.unavailable_after = 0;
  ASSERT_TRUE(Send(CallEngineTest::Parts(8, 4)).ok());
  const int asked = replicas_[0]->service.requests();
  EXPECT_GE(asked, 1);
  auto answers = Send(CallEngineTest::Parts(16, 4));
  ASSERT_TRUE(answers.ok()) << answers.status();
  CallEngineTest::ExpectRowsInOrder(*answers, 16 * 4);
  EXPECT_EQ(replicas_[0]->service.requests(), asked);
  EXPECT_EQ(stats_.answered_by[1], 16);
}

TEST_F(ReplicasTest, APinnedVersionIsAskedOfTheReplicaThatHoldsIt) {
  StartReplicas(3);
  replicas_[0]->service.holds_version = 1;
  replicas_[1]->service.holds_version = 7;
  replicas_[2]->service.holds_version = 1;
  std::vector<CallPart> parts = CallEngineTest::Parts(24, 4);
  for (CallPart& part : parts) part.header.set_model_version(7);
  auto answers = Send(std::move(parts));
  ASSERT_TRUE(answers.ok()) << answers.status();
  CallEngineTest::ExpectRowsInOrder(*answers, 24 * 4);
  EXPECT_EQ(stats_.answered_by, (std::vector<int64_t>{0, 24, 0}));
  for (const ScoreResult& answer : *answers) {
    EXPECT_EQ(answer.model_version, 7);
  }
  EXPECT_GT(stats_.version_moves, 0);
}

TEST_F(ReplicasTest, AVersionNoReplicaHoldsFailsWithItsError) {
  StartReplicas(2);
  replicas_[0]->service.holds_version = 1;
  replicas_[1]->service.holds_version = 2;
  std::vector<CallPart> parts = CallEngineTest::Parts(4, 4);
  for (CallPart& part : parts) part.header.set_model_version(3);
  auto answers = Send(std::move(parts));
  ASSERT_EQ(answers.status().code(), absl::StatusCode::kNotFound)
      << answers.status();
  EXPECT_EQ(v1::DetailsOf(answers.status()).reason,
            v1::kReasonVersionUnavailable);
}

TEST_F(ReplicasTest, EveryReplicaDeadIsUnavailableSayingWhatWasAnswered) {
  StartReplicas(3);
  replicas_[0]->service.unavailable_after = 0;
  replicas_[1]->service.unavailable_after = 0;
  replicas_[2]->service.unavailable_after = 3;
  options_.requests_in_flight_per_connection = 1;
  auto answers = Send(CallEngineTest::Parts(12, 5));
  ASSERT_EQ(answers.status().code(), absl::StatusCode::kUnavailable)
      << answers.status();
  EXPECT_NE(answers.status().message().find("15 of 60 rows answered"),
            std::string::npos)
      << answers.status();
  EXPECT_EQ(v1::DetailsOf(answers.status()).metadata.at("rows_answered"), "15");
  for (auto& replica : replicas_) EXPECT_EQ(replica->window.outstanding(), 0);
}

TEST(ReplicaHealthTest, ADownReplicaIsProbedByOneRequestAfterItsBackoff) {
  ReplicaHealth::Options options;
  options.first_backoff = absl::Seconds(1);
  options.max_backoff = absl::Seconds(3);
  ReplicaHealth health(options);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  bool probe = true;
  ASSERT_TRUE(health.TryUse(t0, &probe));
  EXPECT_FALSE(probe);
  health.Failed(t0);
  health.Failed(t0);  // others in flight fail alike: one backoff
  EXPECT_FALSE(health.up());
  EXPECT_EQ(health.next_probe(), t0 + absl::Seconds(1));
  EXPECT_FALSE(health.Usable(t0 + absl::Milliseconds(999)));
  EXPECT_FALSE(health.TryUse(t0 + absl::Milliseconds(999), &probe));
  ASSERT_TRUE(health.TryUse(t0 + absl::Seconds(1), &probe));
  EXPECT_TRUE(probe);
  EXPECT_FALSE(health.TryUse(t0 + absl::Seconds(1), &probe));  // one probe
  health.Failed(t0 + absl::Seconds(1));
  EXPECT_EQ(health.next_probe(), t0 + absl::Seconds(3));  // doubled
  ASSERT_TRUE(health.TryUse(t0 + absl::Seconds(3), &probe));
  health.Failed(t0 + absl::Seconds(3));
  EXPECT_EQ(health.next_probe(), t0 + absl::Seconds(6));  // at most 3 s
  ASSERT_TRUE(health.TryUse(t0 + absl::Seconds(6), &probe));
  health.AbandonProbe();
  ASSERT_TRUE(health.TryUse(t0 + absl::Seconds(6), &probe));
  EXPECT_TRUE(probe);
  health.Answered();
  EXPECT_TRUE(health.up());
  ASSERT_TRUE(health.TryUse(t0 + absl::Seconds(6), &probe));
  EXPECT_FALSE(probe);
}

}  // namespace
}  // namespace detlogp::client
