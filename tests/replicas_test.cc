// Two server processes with the same weights behind client-side round-robin:
// one determinism key, and every answer bit-identical whichever replica
// served it.
#include <gtest/gtest.h>

#include <cstring>

#include "client/logp_client.h"
#include "client/random_rows.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using testing::ServerProcess;

double RowsComputed(const ServerProcess& server) {
  return server.MetricValue("detlogp_rows_computed_total");
}

TEST(ReplicasTest, RoundRobinOverTwoReplicasGivesOneKeyAndIdenticalBits) {
  auto first = ServerProcess::Start({"--device=cpu", "--metrics_port=0"});
  auto second = ServerProcess::Start({"--device=cpu", "--metrics_port=0"});
  ASSERT_TRUE(first.ok() && second.ok());

  LogpClient::Options alone_options;
  alone_options.target = (*first)->target();
  auto alone = *LogpClient::Create(alone_options);
  LogpClient::Options balanced_options;
  balanced_options.target =
      "ipv4:" + (*first)->target() + "," + (*second)->target();
  balanced_options.load_balancing_policy = "round_robin";
  auto balanced = *LogpClient::Create(balanced_options);

  const int64_t rows = 6;
  const v1::LogProbRequest request = client::MakeLogProbRequest(
      "probe", v1::DTYPE_BFLOAT16, rows, 1024,
      client::RandomBf16Rows(rows, 1024, 77),
      client::RandomTargets(rows, 32000, 78), 0.9f, true);
  auto reference = alone->Score(request);
  ASSERT_TRUE(reference.ok()) << reference.status();

  const int calls = 24;
  int identical = 0;
  for (int i = 0; i < calls; ++i) {
    auto answer = balanced->Score(request);
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->determinism_key, reference->determinism_key);
    if (std::memcmp(answer->logprobs.data(), reference->logprobs.data(),
                    rows * 4) == 0 &&
        std::memcmp(answer->lse.data(), reference->lse.data(), rows * 4) == 0) {
      ++identical;
    }
  }
  EXPECT_EQ(identical, calls);
  // Both replicas served: each computed more than its 2 warm-up rows, and
  // together exactly the calls' rows (plus the reference call).
  const double a = RowsComputed(**first), b = RowsComputed(**second);
  std::cout << "replica rows computed: " << a << " and " << b << "\n";
  EXPECT_GT(a, 2 + rows);
  EXPECT_GT(b, 2);
  EXPECT_EQ(a + b, 2 * 2 + (calls + 1) * rows);
  EXPECT_EQ((*first)->Stop(SIGTERM), 0);
  EXPECT_EQ((*second)->Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace detlogp
