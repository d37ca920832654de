// `detlogp_cli project` against a real server: its first two lines (the
// determinism key and the SHA-256 of Y, compared between GPU and CPU runs by
// tools/device/run_serve.sh) are Y's own digest and key, whether SHA-256
// keeps up with the stream or the stream waits for it; transfer and hashing
// are reported on lines of their own, each holding the word "seconds".
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/logp_client.h"
#include "gtest/gtest.h"
#include "kernels/random_normal.h"
#include "server/models/sha256.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using testing::RunCli;
using testing::ServerProcess;

// The fields of a "name value name value ..." line.
std::vector<std::string> Words(const std::string& line) {
  return absl::StrSplit(line, ' ', absl::SkipEmpty());
}

TEST(CliProjectTest, PrintsYsDigestThenTransferAndHashingApart) {
  auto server = ServerProcess::Start({"--device=cpu", "--cpu_threads=2",
                                      "--synthetic_hidden_size=64",
                                      "--synthetic_vocab_size=1000"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int64_t rows = 1500;
  const uint64_t seed = 7;

  // Y as the library receives it, from the rows the CLI draws.
  kernels::RandomNormal random(seed);
  std::vector<float> x(rows * 96);
  for (float& v : x) v = random.Next(1.0f);
  LogpClient::Options options;
  options.target = (*server)->target();
  options.max_message_bytes = 256 << 20;
  auto client = LogpClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  auto whole = (*client)->Project(x, rows, 200);
  ASSERT_TRUE(whole.ok()) << whole.status();
  server::Sha256 digest;
  digest.Update(whole->y.data(), whole->y.size() * sizeof(float));
  const std::string want_key = "determinism_key " + whole->determinism_key;
  const std::string want_sha = "y_sha256 " + digest.HexDigest();

  // The default backlog, and none (every chunk waits for the one before to
  // be hashed): the same digest either way.
  for (const char* backlog : {"", " --hash_backlog_mb=0"}) {
    SCOPED_TRACE(backlog);
    auto [code, out] = RunCli(absl::StrCat(
        "project --target=", (*server)->target(), " --project_rows=", rows,
        " --rows_per_chunk=200 --seed=", seed, backlog));
    ASSERT_EQ(code, 0) << out;
    const std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 5u) << out;
    EXPECT_EQ(lines[0], want_key);
    EXPECT_EQ(lines[1], want_sha);
    // run_serve.sh drops the lines holding "seconds" and compares the rest.
    for (size_t i = 2; i < lines.size(); ++i) {
      EXPECT_NE(lines[i].find("seconds"), std::string::npos) << lines[i];
    }
    const std::vector<std::string> total = Words(lines[2]);
    ASSERT_EQ(total.size(), 8u) << lines[2];
    EXPECT_EQ(total[0], "rows");
    EXPECT_EQ(total[1], std::to_string(rows));
    EXPECT_EQ(total[2], "chunks");
    EXPECT_EQ(total[3], "8");
    EXPECT_EQ(total[4], "seconds");
    const std::vector<std::string> transfer = Words(lines[3]);
    ASSERT_EQ(transfer.size(), 9u) << lines[3];
    EXPECT_EQ(transfer[0], "transfer");
    EXPECT_EQ(transfer[1], "seconds");
    EXPECT_EQ(transfer[3], "output_GB/s");
    EXPECT_EQ(transfer[7], "waited_for_hashing_seconds");
    const std::vector<std::string> sha = Words(lines[4]);
    ASSERT_EQ(sha.size(), 7u) << lines[4];
    EXPECT_EQ(sha[0], "sha256");
    EXPECT_EQ(sha[1], "seconds");
    EXPECT_GT(std::stod(sha[2]), 0.0);
    EXPECT_EQ(sha[3], "GB/s");
    // The whole call outlasts the stream, which outlasts its first chunk.
    EXPECT_GE(std::stod(total[5]), std::stod(transfer[2]));
    EXPECT_GE(std::stod(transfer[2]), std::stod(transfer[6]));
  }
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

}  // namespace
}  // namespace detlogp
