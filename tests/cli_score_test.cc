// `detlogp_cli score --entropy --top_k=K` against a real CPU server: one
// line per row of "name value" pairs, the top-k lists comma-separated; every
// printed number has the bits LogpClient receives for the same rows (%.9g
// round-trips a float), the lists descend, a smaller K prints a prefix, the
// fields appear only when asked for, and a top_k above the server's maximum
// fails naming top_k. check-invariance checks entropy and top-k bits too.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using testing::RunCli;
using testing::ServerProcess;

constexpr int64_t kHidden = 64;
constexpr int64_t kVocab = 1000;
constexpr int64_t kRows = 4;
constexpr uint64_t kSeed = 11;

// A "row ..." line as {name: value}.
using Fields = std::map<std::string, std::string>;

std::vector<Fields> RowLines(const std::string& out) {
  std::vector<Fields> rows;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    if (!absl::StartsWith(line, "row ")) continue;
    const std::vector<std::string> words =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    Fields fields;
    for (size_t i = 0; i + 1 < words.size(); i += 2)
      fields[words[i]] = words[i + 1];
    EXPECT_EQ(words.size() % 2, 0u) << line;
    rows.push_back(std::move(fields));
  }
  return rows;
}

float ParseFloat(const std::string& text) {
  return std::strtof(text.c_str(), nullptr);
}

std::vector<float> Floats(const std::string& list) {
  std::vector<float> values;
  for (absl::string_view v : absl::StrSplit(list, ',')) {
    values.push_back(ParseFloat(std::string(v)));
  }
  return values;
}

std::vector<int64_t> Ints(const std::string& list) {
  std::vector<int64_t> values;
  for (absl::string_view v : absl::StrSplit(list, ',')) {
    int64_t id = -1;
    EXPECT_TRUE(absl::SimpleAtoi(v, &id)) << list;
    values.push_back(id);
  }
  return values;
}

class CliScoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server =
        ServerProcess::Start({"--device=cpu", "--cpu_threads=1",
                              absl::StrCat("--synthetic_hidden_size=", kHidden),
                              absl::StrCat("--synthetic_vocab_size=", kVocab)});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(SIGTERM), 0) << server_->Log();
    }
    delete server_;
    server_ = nullptr;
  }

  std::string Score(const std::string& flags, int* code) {
    auto [exit_code, out] = RunCli(absl::StrCat(
        "score --target=", server_->target(), " --random_rows=", kRows,
        " --seed=", kSeed, " ", flags, " 2>&1"));
    *code = exit_code;
    return out;
  }

  // The same rows the CLI draws, scored through the library.
  client::ScoreResult Library(bool entropy, int64_t top_k) {
    LogpClient::Options options;
    options.target = server_->target();
    auto client = LogpClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status();
    client::LogProbOptions request_options;
    request_options.return_lse = true;
    request_options.return_entropy = entropy;
    request_options.top_k = top_k;
    auto result = (*client)->Score(client::MakeLogProbRequest(
        "lib", v1::DTYPE_BFLOAT16, kRows, kHidden,
        client::RandomBf16Rows(kRows, kHidden, kSeed),
        client::RandomTargets(kRows, kVocab, kSeed + 1), request_options));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *std::move(result) : client::ScoreResult();
  }

  static ServerProcess* server_;
};

ServerProcess* CliScoreTest::server_ = nullptr;

TEST_F(CliScoreTest, PrintsEntropyAndTopKWithTheLibrarysBits) {
  constexpr int64_t k = 5;
  int code = 0;
  const std::string out =
      Score(absl::StrCat("--return_lse --entropy --top_k=", k), &code);
  ASSERT_EQ(code, 0) << out;
  const std::vector<Fields> rows = RowLines(out);
  ASSERT_EQ(rows.size(), static_cast<size_t>(kRows)) << out;
  const client::ScoreResult want = Library(true, k);
  ASSERT_EQ(want.top_k, k);
  for (int64_t r = 0; r < kRows; ++r) {
    SCOPED_TRACE(r);
    const Fields& row = rows[r];
    for (const char* name : {"row", "target", "logprob", "lse", "entropy",
                             "top_ids", "top_logprobs"}) {
      ASSERT_EQ(row.count(name), 1u) << name << " missing in row " << r << ":\n"
                                     << out;
    }
    EXPECT_EQ(ParseFloat(row.at("logprob")), want.logprobs[r]);
    EXPECT_EQ(ParseFloat(row.at("lse")), want.lse[r]);
    EXPECT_EQ(ParseFloat(row.at("entropy")), want.entropy[r]);
    const std::vector<int64_t> ids = Ints(row.at("top_ids"));
    const std::vector<float> values = Floats(row.at("top_logprobs"));
    ASSERT_EQ(ids.size(), static_cast<size_t>(k));
    ASSERT_EQ(values.size(), static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(ids[j], want.top_ids[r * k + j]);
      EXPECT_EQ(values[j], want.top_logprobs[r * k + j]);
      EXPECT_GE(ids[j], 0);
      EXPECT_LT(ids[j], kVocab);
      if (j > 0) {
        EXPECT_LE(values[j], values[j - 1]);
      }
    }
    EXPECT_GE(ParseFloat(row.at("entropy")), 0.0f);
  }
}

TEST_F(CliScoreTest, SmallerTopKPrintsAPrefix) {
  int code = 0;
  const std::string big = Score("--top_k=8", &code);
  ASSERT_EQ(code, 0) << big;
  const std::string small = Score("--top_k=3", &code);
  ASSERT_EQ(code, 0) << small;
  const std::vector<Fields> big_rows = RowLines(big);
  const std::vector<Fields> small_rows = RowLines(small);
  ASSERT_EQ(big_rows.size(), small_rows.size());
  for (size_t r = 0; r < big_rows.size(); ++r) {
    const std::vector<std::string> big_ids =
        absl::StrSplit(big_rows[r].at("top_ids"), ',');
    const std::vector<std::string> big_values =
        absl::StrSplit(big_rows[r].at("top_logprobs"), ',');
    ASSERT_EQ(big_ids.size(), 8u);
    std::vector<std::string> prefix_ids(big_ids.begin(), big_ids.begin() + 3);
    std::vector<std::string> prefix_values(big_values.begin(),
                                           big_values.begin() + 3);
    EXPECT_EQ(small_rows[r].at("top_ids"), absl::StrJoin(prefix_ids, ","));
    EXPECT_EQ(small_rows[r].at("top_logprobs"),
              absl::StrJoin(prefix_values, ","));
    EXPECT_EQ(small_rows[r].at("logprob"), big_rows[r].at("logprob"));
    EXPECT_EQ(small_rows[r].count("entropy"), 0u);
  }
}

TEST_F(CliScoreTest, FieldsOnlyWhenAsked) {
  int code = 0;
  const std::string plain = Score("", &code);
  ASSERT_EQ(code, 0) << plain;
  const std::string entropy = Score("--entropy", &code);
  ASSERT_EQ(code, 0) << entropy;
  const std::vector<Fields> plain_rows = RowLines(plain);
  const std::vector<Fields> entropy_rows = RowLines(entropy);
  ASSERT_EQ(plain_rows.size(), static_cast<size_t>(kRows)) << plain;
  ASSERT_EQ(entropy_rows.size(), static_cast<size_t>(kRows)) << entropy;
  for (int64_t r = 0; r < kRows; ++r) {
    // row, target, logprob: the former output, unchanged.
    EXPECT_EQ(plain_rows[r].size(), 3u) << plain;
    EXPECT_EQ(entropy_rows[r].size(), 4u) << entropy;
    EXPECT_EQ(entropy_rows[r].count("entropy"), 1u);
    EXPECT_EQ(entropy_rows[r].count("top_ids"), 0u);
    EXPECT_EQ(entropy_rows[r].at("logprob"), plain_rows[r].at("logprob"));
  }
}

// --target=dns:///localhost:<port>: the CLI's client makes every address
// of localhost a replica (nothing listens on ::1: its requests move to
// 127.0.0.1) and prints the rows a plain target prints.
TEST_F(CliScoreTest, ADnsTargetPrintsTheSameRows) {
  int code = 0;
  const std::string plain = Score("", &code);
  ASSERT_EQ(code, 0) << plain;
  auto [dns_code, by_name] = RunCli(
      absl::StrCat("score --target=dns:///localhost:", server_->port(),
                   " --random_rows=", kRows, " --seed=", kSeed, " 2>&1"));
  ASSERT_EQ(dns_code, 0) << by_name;
  const std::vector<Fields> plain_rows = RowLines(plain);
  const std::vector<Fields> dns_rows = RowLines(by_name);
  ASSERT_EQ(dns_rows.size(), static_cast<size_t>(kRows)) << by_name;
  for (int64_t r = 0; r < kRows; ++r) {
    EXPECT_EQ(dns_rows[r], plain_rows[r]) << by_name;
  }
}

// --shared_memory sends the rows through a region (the server is on
// loopback, so it allows it) with the same printed bits; --timing says where
// the time went and which path the rows took.
TEST_F(CliScoreTest, SharedMemoryPrintsTheSameRowsAndTimingSaysSo) {
  int code = 0;
  const std::string plain = Score("--return_lse --timing", &code);
  ASSERT_EQ(code, 0) << plain;
  const std::string shared =
      Score("--return_lse --timing --shared_memory", &code);
  ASSERT_EQ(code, 0) << shared;
  EXPECT_EQ(RowLines(plain), RowLines(shared));
  EXPECT_EQ(RowLines(shared).size(), static_cast<size_t>(kRows));
  for (const auto& [out, path] :
       {std::pair{plain, "grpc"}, std::pair{shared, "system_shm"}}) {
    std::map<std::string, std::string> timing;
    for (absl::string_view line :
         absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      if (!absl::StartsWith(line, "timing ")) continue;
      const std::vector<std::string> words =
          absl::StrSplit(line.substr(7), ' ', absl::SkipEmpty());
      for (size_t i = 0; i + 1 < words.size(); i += 2) {
        timing[words[i]] = words[i + 1];
      }
    }
    ASSERT_FALSE(timing.empty()) << out;
    EXPECT_EQ(timing["path"], path) << out;
    EXPECT_EQ(timing["requests"], "1");
    int64_t call_us = 0, server_us = 0, compute_us = 0;
    ASSERT_TRUE(absl::SimpleAtoi(timing["call_us"], &call_us));
    ASSERT_TRUE(absl::SimpleAtoi(timing["server_us"], &server_us));
    ASSERT_TRUE(absl::SimpleAtoi(timing["compute_us"], &compute_us));
    EXPECT_GT(compute_us, 0);
    EXPECT_GE(server_us, compute_us);
    EXPECT_GE(call_us, server_us);
  }
}

TEST_F(CliScoreTest, TopKAboveTheMaximumFailsNamingTopK) {
  int code = 0;
  // The server's default --max_top_k is 20.
  const std::string out = Score("--top_k=21", &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("INVALID_ARGUMENT"), std::string::npos) << out;
  EXPECT_NE(out.find("top_k"), std::string::npos) << out;
  EXPECT_TRUE(RowLines(out).empty()) << out;
}

// check-invariance with --entropy --top_k: probes hidden among filler rows
// in calls that ask for entropy, top-k lists of random sizes, both or
// neither keep their solo bits (a smaller k: a prefix of the solo list).
TEST_F(CliScoreTest, CheckInvarianceCoversEntropyAndTopK) {
  auto [code, out] = RunCli(absl::StrCat(
      "check-invariance --target=", server_->target(),
      " --probes=8 --concurrency=6 --calls_per_thread=4 --channels=2 --entropy "
      "--top_k=20 2>&1"));
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StartsWith(out, "INVARIANT: ")) << out;
  EXPECT_TRUE(absl::StrContains(out, " 0 with different bits")) << out;
  EXPECT_FALSE(absl::StrContains(out, "entropy checked on 0,")) << out;
  EXPECT_FALSE(absl::StrContains(out, "top-k on 0)")) << out;
}

}  // namespace
}  // namespace detlogp
