// One client over a fleet of real CPU servers: a "dns:" target followed as
// its records change (calls spread over every address, an added address
// gets requests, a removed one drains, a failed replica makes the client
// resolve again), and rows in the client's own system regions spread over
// every replica on this host and failing over when one is killed.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "client/target_resolver.h"
#include "tests/replica_kill_run.h"
#include "tests/score_result_bits.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using client::ScoreResult;
using testing::SameBits;
using testing::ServerProcess;
using v1::LogProbRequest;

constexpr int64_t kHidden = 256;
constexpr int64_t kVocab = 4096;

std::unique_ptr<ServerProcess> StartReplica(
    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "--device=cpu", absl::StrCat("--synthetic_hidden_size=", kHidden),
      absl::StrCat("--synthetic_vocab_size=", kVocab), "--metrics_port=0"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto server = ServerProcess::Start(args);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

double RowsComputed(const ServerProcess& server) {
  return server.MetricValue("detlogp_rows_computed_total");
}

LogProbRequest Request(int64_t rows, uint64_t seed) {
  client::LogProbOptions extras;
  extras.return_lse = true;
  return client::MakeLogProbRequest(
      absl::StrCat("fleet", seed), v1::DTYPE_BFLOAT16, rows, kHidden,
      client::RandomBf16Rows(rows, kHidden, seed),
      client::RandomTargets(rows, kVocab, seed + 1), extras);
}

// A resolver whose answer the test sets, and how often it was asked.
class FakeDns {
 public:
  void Set(std::vector<std::string> targets) {
    absl::MutexLock lock(&mu_);
    targets_ = std::move(targets);
  }
  int asked() const {
    absl::MutexLock lock(&mu_);
    return asked_;
  }
  client::TargetResolver Resolver() {
    return [this](const std::string& host, const std::string& port)
               -> absl::StatusOr<std::vector<std::string>> {
      EXPECT_EQ(host, "detlogp.fleet.test");
      EXPECT_EQ(port, "50051");
      absl::MutexLock lock(&mu_);
      ++asked_;
      return targets_;
    };
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> targets_ ABSL_GUARDED_BY(mu_);
  int asked_ ABSL_GUARDED_BY(mu_) = 0;
};

// The reference answer: the same rows from one server alone.
ScoreResult Alone(const ServerProcess& server, const LogProbRequest& request) {
  LogpClient::Options options;
  options.target = server.target();
  auto client = *LogpClient::Create(options);
  auto answer = client->Score(request);
  EXPECT_TRUE(answer.ok()) << answer.status();
  return *std::move(answer);
}

TEST(DnsTargetTest, ParsesTheNameAndPort) {
  auto name = client::ParseDnsTarget("dns:///detlogp.ns.svc:50051");
  ASSERT_TRUE(name.ok() && name->has_value());
  EXPECT_EQ((*name)->host, "detlogp.ns.svc");
  EXPECT_EQ((*name)->port, "50051");
  name = client::ParseDnsTarget("dns://8.8.8.8/pods.local:7");
  ASSERT_TRUE(name.ok() && name->has_value());
  EXPECT_EQ((*name)->host, "pods.local");
  EXPECT_EQ((*name)->port, "7");
  name = client::ParseDnsTarget("dns:[::1]:9");
  ASSERT_TRUE(name.ok() && name->has_value());
  EXPECT_EQ((*name)->host, "::1");
  EXPECT_EQ((*name)->port, "9");
  name = client::ParseDnsTarget("127.0.0.1:50051");
  ASSERT_TRUE(name.ok());
  EXPECT_FALSE(name->has_value());
  EXPECT_EQ(client::ParseDnsTarget("dns:///no-port").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client::ParseDnsTarget("dns:///:80").status().code(),
            absl::StatusCode::kInvalidArgument);

  LogpClient::Options options;
  options.targets = {"127.0.0.1:1", "dns:///no-port"};
  auto refused = LogpClient::Create(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "targets[1]: "))
      << refused.status();
}

TEST(DnsTargetTest, GetaddrinfoGivesEveryAddressWithThePort) {
  auto v4 = client::ResolveWithGetaddrinfo("127.0.0.1", "50051");
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(*v4, std::vector<std::string>{"127.0.0.1:50051"});
  auto v6 = client::ResolveWithGetaddrinfo("::1", "7");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(*v6, std::vector<std::string>{"[::1]:7"});
  EXPECT_EQ(client::ResolveWithGetaddrinfo("no-such-host.invalid", "1")
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
}

// A StatefulSet's pods behind a headless Service: reverse DNS names each
// "<set>-<ordinal>.<service>...", and a push chains them in ordinal order
// (pod 10 after pod 9, whatever their addresses); anything else keeps the
// addresses' order.
TEST(DnsTargetTest, PodsAreOrderedByOrdinalWhenReverseDnsNamesThem) {
  const std::vector<std::string> addresses = {"10.0.0.3:7", "10.0.0.5:7",
                                              "10.0.0.8:7", "[fd00::1]:7"};
  auto names = [](std::map<std::string, std::string> of) {
    return [of](const std::string& address) {
      auto it = of.find(address);
      return it == of.end() ? std::string() : it->second;
    };
  };
  EXPECT_EQ(
      client::InPodOrdinalOrder(
          addresses,
          names({{"10.0.0.3:7", "detlogp-10.detlogp.ns.svc.cluster.local"},
                 {"10.0.0.5:7", "detlogp-2.detlogp.ns.svc.cluster.local"},
                 {"10.0.0.8:7", "detlogp-9.detlogp.ns.svc.cluster.local"},
                 {"[fd00::1]:7", "detlogp-0.detlogp.ns.svc.cluster.local"}})),
      (std::vector<std::string>{"[fd00::1]:7", "10.0.0.5:7", "10.0.0.8:7",
                                "10.0.0.3:7"}));
  const std::vector<std::map<std::string, std::string>> unordered = {
      // One address without a name.
      {{"10.0.0.3:7", "detlogp-1.x"},
       {"10.0.0.5:7", "detlogp-0.x"},
       {"10.0.0.8:7", "detlogp-2.x"}},
      // Pods of two sets.
      {{"10.0.0.3:7", "detlogp-1.x"},
       {"10.0.0.5:7", "other-0.x"},
       {"10.0.0.8:7", "detlogp-2.x"},
       {"[fd00::1]:7", "detlogp-3.x"}},
      // A name without an ordinal, and one ordinal twice.
      {{"10.0.0.3:7", "detlogp-1.x"},
       {"10.0.0.5:7", "detlogp.x"},
       {"10.0.0.8:7", "detlogp-2.x"},
       {"[fd00::1]:7", "detlogp-3.x"}},
      {{"10.0.0.3:7", "detlogp-1.x"},
       {"10.0.0.5:7", "detlogp-1.y"},
       {"10.0.0.8:7", "detlogp-2.x"},
       {"[fd00::1]:7", "detlogp-3.x"}},
      {{"10.0.0.3:7", "detlogp-1.x"},
       {"10.0.0.5:7", "detlogp-0x2.x"},
       {"10.0.0.8:7", "detlogp-2.x"},
       {"[fd00::1]:7", "-3.x"}},
  };
  for (const auto& of : unordered) {
    EXPECT_EQ(client::InPodOrdinalOrder(addresses, names(of)), addresses);
  }
  // The system's reverse DNS, looked up side by side: not an address has
  // no name; loopback's has no ordinal.
  EXPECT_EQ(client::ReverseResolveWithGetnameinfo("not an address:1"), "");
  const std::vector<std::string> looked_up = client::ReverseNamesWithin(
      {"not an address:1", "127.0.0.1:7", "[::1]:7"},
      client::ReverseResolveWithGetnameinfo, absl::Seconds(30));
  ASSERT_EQ(looked_up.size(), 3u);
  EXPECT_EQ(looked_up[0], "");
  EXPECT_EQ(looked_up[1], client::ReverseResolveWithGetnameinfo("127.0.0.1:7"));
  EXPECT_EQ(looked_up[2], client::ReverseResolveWithGetnameinfo("[::1]:7"));
  // A resolver that does not answer in time: no names, and the call returns
  // while its lookup still waits.
  auto release = std::make_shared<absl::Notification>();
  const std::vector<std::string> late = client::ReverseNamesWithin(
      {"10.0.0.3:7", "10.0.0.5:7"},
      [release](const std::string& address) {
        if (address == "10.0.0.5:7") release->WaitForNotification();
        return std::string("detlogp-0.x");
      },
      absl::Milliseconds(50));
  release->Notify();
  EXPECT_EQ(late, (std::vector<std::string>{"", ""}));
  auto local = client::ResolveInPodOrder("127.0.0.1", "50051");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(*local, std::vector<std::string>{"127.0.0.1:50051"});
}

// "dns:///localhost:<port>" through the system resolver: every address of
// localhost is a replica (::1 too, where nothing listens: its requests fail
// over to 127.0.0.1 within the call).
TEST(DnsTargetTest, LocalhostThroughGetaddrinfoServes) {
  auto server = StartReplica();
  ASSERT_NE(server, nullptr);
  const LogProbRequest request = Request(64, 5);
  const ScoreResult alone = Alone(*server, request);
  LogpClient::Options options;
  options.target = absl::StrCat("dns:///localhost:", server->port());
  options.max_request_rows = 8;
  auto client = *LogpClient::Create(options);
  const std::vector<std::string> replicas = client->replica_targets();
  EXPECT_NE(std::find(replicas.begin(), replicas.end(),
                      absl::StrCat("127.0.0.1:", server->port())),
            replicas.end())
      << absl::StrJoin(replicas, ",");
  for (int i = 0; i < 3; ++i) {
    auto answer = client->Score(request);
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_TRUE(SameBits(*answer, alone));
  }
  EXPECT_EQ(server->Stop(SIGTERM), 0);
}

// One name, its records changed by the test: calls spread over every
// address; an address added gets requests after the next resolution (due
// after dns_refresh_interval on the client's clock, or after a replica
// failed); one removed drains: the call holding requests there finishes
// with them, and no later request goes there.
TEST(DnsTargetTest, ReplicasFollowTheNamesRecords) {
  std::vector<std::unique_ptr<ServerProcess>> servers;
  for (int i = 0; i < 4; ++i) {
    servers.push_back(StartReplica());
    ASSERT_NE(servers.back(), nullptr);
  }
  ServerProcess &a = *servers[0], &b = *servers[1], &c = *servers[2],
                &d = *servers[3];
  const LogProbRequest request = Request(256, 11);
  const ScoreResult alone = Alone(a, request);

  FakeDns dns;
  dns.Set({a.target()});
  absl::Mutex clock_mu;
  absl::Time now = absl::UnixEpoch();
  LogpClient::Options options;
  options.targets = {"dns:///detlogp.fleet.test:50051"};
  options.resolver = dns.Resolver();
  options.dns_refresh_interval = absl::Seconds(30);
  options.clock = [&] {
    absl::MutexLock lock(&clock_mu);
    return now;
  };
  options.max_request_rows = 8;  // 32 requests a call
  auto client = *LogpClient::Create(options);
  EXPECT_EQ(dns.asked(), 1);
  EXPECT_EQ(client->replica_targets(), std::vector<std::string>{a.target()});

  auto score = [&](const char* when) {
    auto answer = client->Score(request);
    EXPECT_TRUE(answer.ok()) << when << ": " << answer.status();
    if (answer.ok()) {
      EXPECT_TRUE(SameBits(*answer, alone)) << when;
    }
    return answer.ok() ? *std::move(answer) : ScoreResult{};
  };
  const double b_before = RowsComputed(b);
  score("one address");
  EXPECT_EQ(RowsComputed(b), b_before);

  // B joins; the client sees it once the interval passed on its clock.
  dns.Set({a.target(), b.target()});
  score("before the interval");
  EXPECT_EQ(RowsComputed(b), b_before);
  {
    absl::MutexLock lock(&clock_mu);
    now += absl::Seconds(31);
  }
  const double a_before = RowsComputed(a);
  ScoreResult spread = score("two addresses");
  EXPECT_EQ(dns.asked(), 2);
  EXPECT_EQ(spread.replicas_answering, 2);
  EXPECT_GT(RowsComputed(a), a_before);
  EXPECT_GT(RowsComputed(b), b_before);

  // A leaves the records while a large call holds requests there: the
  // call finishes (no request failed or moved), and A gets nothing after.
  const LogProbRequest large = Request(4096, 12);
  const ScoreResult large_alone = Alone(b, large);
  const double a_at_start = RowsComputed(a);
  absl::StatusOr<ScoreResult> drained;
  std::thread caller([&] { drained = client->Score(large); });
  // Until A computed some of the call's rows.
  for (int i = 0; i < 2000 && RowsComputed(a) == a_at_start; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  dns.Set({b.target()});
  ASSERT_TRUE(client->RefreshReplicas().ok());
  caller.join();
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_TRUE(SameBits(*drained, large_alone));
  EXPECT_EQ(drained->replica_retries, 0);
  EXPECT_EQ(client->replica_targets(), std::vector<std::string>{b.target()});
  const double a_drained = RowsComputed(a);
  ScoreResult after = score("after A left");
  EXPECT_EQ(after.replicas_answering, 1);
  EXPECT_EQ(RowsComputed(a), a_drained);

  // The records name B and C, then D too; B is killed: the next call
  // moves B's requests to C, and the client resolves again after that
  // failure (no clock change), so the call after it reaches D.
  dns.Set({b.target(), c.target()});
  {
    absl::MutexLock lock(&clock_mu);
    now += absl::Seconds(31);
  }
  score("B and C");
  const int asked = dns.asked();
  dns.Set({b.target(), c.target(), d.target()});
  EXPECT_EQ(b.Stop(SIGKILL), 128 + SIGKILL);
  const double d_before = RowsComputed(d);
  ScoreResult failed_over = score("B killed");
  EXPECT_GT(failed_over.replica_retries, 0);
  score("after the failure");
  EXPECT_EQ(dns.asked(), asked + 1);
  EXPECT_GT(RowsComputed(d), d_before);
  for (auto* server : {&a, &c, &d}) EXPECT_EQ(server->Stop(SIGTERM), 0);
}

// Rows in the client's system regions: registered with each of three
// replicas on this host, a call's requests spread over them (each server's
// rows grow, the answer has the bits of one server alone), and with one
// replica killed (SIGKILL) while eight threads score through regions, no
// call fails and every answer keeps its bits.
TEST(FleetRegionsTest, RegionCallsSpreadAndSurviveAKilledReplica) {
  std::vector<std::unique_ptr<ServerProcess>> servers;
  LogpClient::Options options;
  for (int i = 0; i < 3; ++i) {
    servers.push_back(StartReplica());
    ASSERT_NE(servers.back(), nullptr);
    options.targets.push_back(servers.back()->target());
  }
  options.system_shared_memory = true;
  options.max_request_rows = 64;
  auto client = *LogpClient::Create(options);

  const LogProbRequest large = Request(4096, 21);
  const ScoreResult alone = Alone(*servers[1], large);
  std::vector<double> before;
  for (const auto& server : servers) before.push_back(RowsComputed(*server));
  auto answer = client->Score(large);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->path, "system_shm");
  EXPECT_TRUE(SameBits(*answer, alone));
  EXPECT_EQ(answer->replicas_answering, 3);
  int grew = 0;
  for (size_t r = 0; r < servers.size(); ++r) {
    if (RowsComputed(*servers[r]) > before[r]) ++grew;
  }
  EXPECT_EQ(grew, 3);

  constexpr int kThreads = 8;
  std::vector<LogProbRequest> requests;
  std::vector<ScoreResult> references;
  for (int t = 0; t < kThreads; ++t) {
    requests.push_back(Request(1024, 100 + t));
    references.push_back(Alone(*servers[1], requests.back()));
  }
  testing::KillRun run;
  run.path = "system_shm";
  const testing::KillRunCounts counts = testing::ScoreWhileKilling(
      *client, requests, references, *servers[0], run);
  EXPECT_EQ(counts.failed, 0);
  EXPECT_EQ(counts.wrong_bits, 0);
  EXPECT_EQ(counts.other_path, 0);
  EXPECT_GT(counts.replica_retries, 0);
  for (int r = 1; r < 3; ++r) EXPECT_EQ(servers[r]->Stop(SIGTERM), 0);
}

// A replica that refuses regions (as one on another host does) keeps
// getting calls whose rows travel in messages; calls through regions go to
// the replicas that accepted them, and regions stay on for the client.
TEST(FleetRegionsTest, ARefusingReplicaGetsNoRegionCallsAndTheOthersDo) {
  auto refusing = StartReplica({"--allow_shared_memory=false"});
  auto accepting = StartReplica();
  ASSERT_TRUE(refusing != nullptr && accepting != nullptr);
  LogpClient::Options options;
  options.targets = {refusing->target(), accepting->target()};
  options.system_shared_memory = true;
  options.max_request_rows = 64;
  auto client = *LogpClient::Create(options);
  const LogProbRequest large = Request(2048, 31);
  const ScoreResult alone = Alone(*accepting, large);
  const double refusing_before = RowsComputed(*refusing);
  const double accepting_before = RowsComputed(*accepting);
  for (int i = 0; i < 3; ++i) {
    auto answer = client->Score(large);
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->path, "system_shm");
    EXPECT_TRUE(answer->path_refused.empty());
    EXPECT_EQ(answer->replicas_answering, 1);
    EXPECT_TRUE(SameBits(*answer, alone));
  }
  EXPECT_EQ(RowsComputed(*refusing), refusing_before);
  EXPECT_EQ(RowsComputed(*accepting), accepting_before + 3 * 2048);
  EXPECT_TRUE(client->shared_memory_refusal().empty());
  EXPECT_EQ(refusing->Stop(SIGTERM), 0);
  EXPECT_EQ(accepting->Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace detlogp
