// `detlogp_cli project` against a real server: its first two lines (the
// determinism key and the SHA-256 of Y, compared between GPU and CPU runs by
// `tools/device/run_suite.sh serve`) are Y's own digest and key, whether
// SHA-256 keeps up with the stream or the stream waits for it; transfer and
// hashing are reported on lines of their own, each holding the word "seconds".
#include <grpcpp/client_context.h>
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/heap_retention.h"
#include "client/logp_client.h"
#include "gtest/gtest.h"
#include "kernels/random_normal.h"
#include "digests/sha256.h"
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
  digests::Sha256 digest;
  digest.Update(whole->y.data(), whole->y.size() * sizeof(float));
  const std::string y_hex = digest.HexDigest();  // once: it finishes the digest

  // The raw read path against protobuf's own parse of the same stream.
  {
    v1::ProjectRequest request;
    request.set_request_id("proto");
    request.set_rows_per_chunk(200);
    request.mutable_x()->set_dtype(v1::DTYPE_FLOAT32);
    request.mutable_x()->add_shape(rows);
    request.mutable_x()->add_shape(96);
    request.mutable_x()->set_data(reinterpret_cast<const char*>(x.data()),
                                  x.size() * sizeof(float));
    grpc::ClientContext context;
    (*client)->PrepareContext(&context);
    auto reader = (*client)->projection_stub()->Project(&context, request);
    digests::Sha256 proto_digest;
    v1::ProjectResponse chunk;
    while (reader->Read(&chunk)) proto_digest.Update(chunk.y().data());
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(proto_digest.HexDigest(), y_hex);
  }
  // Chunks kept past their callback (moved out: no copy) still hold their
  // bytes once the stream is done and equal Project's rows; Y delivered into
  // the caller's buffer is the same.
  {
    std::vector<client::ProjectChunk> kept;
    std::vector<float> y(rows * 5376);
    LogpClient::ProjectOptions project;
    project.rows_per_chunk = 200;
    project.y = y.data();
    auto chunks = (*client)->ProjectChunks(
        x, rows, project,
        [&](client::ProjectChunk& chunk) { kept.push_back(std::move(chunk)); });
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    EXPECT_EQ(chunks->chunks, 8);
    EXPECT_EQ(chunks->determinism_key, whole->determinism_key);
    EXPECT_TRUE(y == whole->y);
    ASSERT_EQ(kept.size(), 8u);
    digests::Sha256 kept_digest;
    for (const client::ProjectChunk& chunk : kept) {
      for (absl::string_view piece : chunk.y_data) {
        kept_digest.Update(piece.data(), piece.size());
      }
    }
    EXPECT_EQ(kept_digest.HexDigest(), y_hex);
  }
  const std::string want_key = "determinism_key " + whole->determinism_key;
  const std::string want_sha = "y_sha256 " + y_hex;

  // The default backlog and none (every chunk waits for the one before to
  // be hashed), one call (the default for a projection this small) and
  // several (hashed in row order): the same digest every way.
  for (const char* flags : {"", " --hash_backlog_mb=0", " --project_streams=1",
                            " --project_streams=3 --hash_backlog_mb=0"}) {
    SCOPED_TRACE(flags);
    auto [code, out] = RunCli(absl::StrCat(
        "project --target=", (*server)->target(), " --project_rows=", rows,
        " --rows_per_chunk=200 --seed=", seed, flags));
    ASSERT_EQ(code, 0) << out;
    const std::vector<std::string> lines =
        absl::StrSplit(out, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 6u) << out;
    EXPECT_EQ(lines[0], want_key);
    EXPECT_EQ(lines[1], want_sha);
    // The serve suite compares the first two lines; the others hold
    // "seconds".
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
    ASSERT_EQ(transfer.size(), 11u) << lines[3];
    EXPECT_EQ(transfer[0], "transfer");
    EXPECT_EQ(transfer[1], "seconds");
    EXPECT_EQ(transfer[3], "output_GB/s");
    EXPECT_EQ(transfer[7], "waited_for_hashing_seconds");
    EXPECT_EQ(transfer[9], "streams");
    EXPECT_EQ(transfer[10], absl::StrContains(flags, "streams=3") ? "3" : "1");
    const std::vector<std::string> sha = Words(lines[4]);
    ASSERT_EQ(sha.size(), 7u) << lines[4];
    EXPECT_EQ(sha[0], "sha256");
    EXPECT_EQ(sha[1], "seconds");
    EXPECT_GT(std::stod(sha[2]), 0.0);
    EXPECT_EQ(sha[3], "GB/s");
    const std::vector<std::string> usage = Words(lines[5]);
    ASSERT_EQ(usage.size(), 9u) << lines[5];
    EXPECT_EQ(usage[0], "client");
    EXPECT_EQ(usage[1], "cpu_seconds");
    EXPECT_GT(std::stod(usage[2]), 0.0);
    EXPECT_EQ(usage[3], "minor_page_faults");
    // malloc as the environment left it: no re-execution without
    // --project_malloc_tuning.
    EXPECT_EQ(usage[7], "malloc_hugetlb");
    EXPECT_EQ(usage[8],
              client::MallocHugePagesTunable(std::getenv("GLIBC_TUNABLES"))
                  .value_or("-"));
    // The whole call outlasts the stream, which outlasts its first chunk.
    EXPECT_GE(std::stod(total[5]), std::stod(transfer[2]));
    EXPECT_GE(std::stod(transfer[2]), std::stod(transfer[6]));
  }

  // --nohash_y: the stream alone; the same lines, no digest. Two runs in
  // one process (--project_repeats), with --project_malloc_tuning: the CLI
  // re-executed itself with huge pages for the heap, unless this
  // environment already chose a value.
  auto [code, out] = RunCli(absl::StrCat(
      "project --target=", (*server)->target(), " --project_rows=", rows,
      " --rows_per_chunk=200 --nohash_y --project_repeats=2 "
      "--project_malloc_tuning --seed=",
      seed));
  ASSERT_EQ(code, 0) << out;
  const std::vector<std::string> lines =
      absl::StrSplit(out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 12u) << out;
  for (int run : {0, 6}) {
    EXPECT_EQ(lines[run], want_key);
    EXPECT_EQ(lines[run + 1], "y_sha256 -");
    EXPECT_EQ(Words(lines[run + 3])[0], "transfer");
    EXPECT_EQ(Words(lines[run + 5]).back(),
              client::MallocHugePagesTunable(std::getenv("GLIBC_TUNABLES"))
                  .value_or("1"))
        << lines[run + 5];
  }
  EXPECT_NE(RunCli(absl::StrCat("project --target=", (*server)->target(),
                                " --project_repeats=0"))
                .first,
            0);
  client->reset();  // an idle connection holds the server's drain
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

// ProjectOptions::streams: the rows go round several calls in blocks; Y,
// the key and the chunks (handed over in row order) are those of one stream,
// whatever the number of calls and the block size, a short last block
// included. No more calls run than there are blocks. Three projection
// launches in flight (--projection_threads) complete out of order; the
// chunks still arrive in order.
TEST(CliProjectTest, InterleavedCallsGiveOneStreamsRowsInRowOrder) {
  // A short grace: a connection a reset client leaves behind can hold
  // SIGTERM's drain (gRPC waits for it up to the grace).
  auto server = ServerProcess::Start(
      {"--device=cpu", "--cpu_threads=2", "--synthetic_hidden_size=64",
       "--synthetic_vocab_size=1000", "--shutdown_grace_s=3",
       "--projection_threads=3"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int64_t rows = 1000;
  kernels::RandomNormal random(11);
  std::vector<float> x(rows * 96);
  for (float& v : x) v = random.Next(1.0f);
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = LogpClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  auto whole = (*client)->Project(x, rows);
  ASSERT_TRUE(whole.ok()) << whole.status();
  digests::Sha256 whole_digest;
  whole_digest.Update(whole->y.data(), whole->y.size() * sizeof(float));
  const std::string y_hex = whole_digest.HexDigest();

  struct Case {
    int streams;
    int64_t rows_per_chunk;
    int64_t block;
    int calls;
  };
  for (const Case& c : {Case{2, 128, 128, 2}, Case{3, 200, 200, 3},
                        Case{4, 0, LogpClient::kInterleavedBlockRows, 2},
                        Case{8, 300, 300, 4}, Case{3, 7, 7, 3}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.streams << " streams, rows_per_chunk "
                 << c.rows_per_chunk);
    std::vector<float> y(rows * 5376);
    LogpClient::ProjectOptions project;
    project.streams = c.streams;
    project.rows_per_chunk = c.rows_per_chunk;
    project.y = y.data();
    std::vector<int64_t> offsets;
    digests::Sha256 digest;
    auto result = (*client)->ProjectChunks(
        x, rows, project, [&](client::ProjectChunk& chunk) {
          offsets.push_back(chunk.row_offset);
          for (absl::string_view piece : chunk.y_data)
            digest.Update(piece.data(), piece.size());
        });
    ASSERT_TRUE(result.ok()) << result.status();
    const int64_t blocks = (rows + c.block - 1) / c.block;
    EXPECT_EQ(result->chunks, blocks);
    EXPECT_EQ(result->streams, c.calls);
    EXPECT_EQ(result->determinism_key, whole->determinism_key);
    EXPECT_TRUE(y == whole->y);
    ASSERT_EQ(static_cast<int64_t>(offsets.size()), blocks);
    for (int64_t b = 0; b < blocks; ++b) ASSERT_EQ(offsets[b], b * c.block);
    EXPECT_EQ(digest.HexDigest(), y_hex);
  }

  // Without a consumer: Y only, copied by the reading threads.
  std::vector<float> y(rows * 5376);
  LogpClient::ProjectOptions project;
  project.streams = 4;
  project.rows_per_chunk = 100;
  project.y = y.data();
  auto result = (*client)->ProjectChunks(x, rows, project);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(y == whole->y);

  // A failure ends every call and comes back as it is: three blocks of
  // 2049 rows, above the server's --projection_max_launch_rows (2048).
  const std::vector<float> long_x(3 * 2049 * 96, 0.5f);
  project.rows_per_chunk = 2049;
  project.y = nullptr;
  auto refused = (*client)->ProjectChunks(long_x, 3 * 2049, project);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "rows_per_chunk"))
      << refused.status();
  project.streams = -1;
  EXPECT_TRUE(absl::StrContains(
      (*client)->ProjectChunks(x, rows, project).status().message(),
      "streams"));
  // A deadline that passes mid-stream (40,000 rows take seconds here).
  LogpClient::Options hurried = options;
  hurried.timeout = absl::Milliseconds(300);
  auto hurried_client = LogpClient::Create(hurried);
  ASSERT_TRUE(hurried_client.ok());
  project.streams = 4;
  project.rows_per_chunk = 100;
  const std::vector<float> video_x(40000 * 96, 0.5f);
  int64_t chunks_before_deadline = 0;
  EXPECT_EQ((*hurried_client)
                ->ProjectChunks(
                    video_x, 40000, project,
                    [&](client::ProjectChunk&) { ++chunks_before_deadline; })
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(chunks_before_deadline, 400);
  // Idle connections hold a server's SIGTERM drain (gRPC waits for them,
  // up to --shutdown_grace_s): close them first.
  client->reset();
  hurried_client->reset();
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

// By default the client picks the calls by the projection's size: one below
// kAutoStreamsMinRows, kAutoStreamsCalls from there on, with the same Y.
TEST(CliProjectTest, DefaultStreamsFollowTheProjectionsSize) {
  auto server = ServerProcess::Start(
      {"--device=cpu", "--cpu_threads=2", "--synthetic_hidden_size=64",
       "--synthetic_vocab_size=1000", "--shutdown_grace_s=3"});
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = LogpClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  kernels::RandomNormal random(29);
  const int64_t big = LogpClient::kAutoStreamsMinRows;
  std::vector<float> x(big * 96);
  for (float& v : x) v = random.Next(1.0f);
  for (const int64_t rows : {big - 1, big}) {
    const std::vector<float> rows_x(x.begin(), x.begin() + rows * 96);
    LogpClient::ProjectOptions project;  // streams: kAutoStreams
    std::vector<float> y(rows * 5376);
    project.y = y.data();
    auto automatic = (*client)->ProjectChunks(rows_x, rows, project);
    ASSERT_TRUE(automatic.ok()) << automatic.status();
    EXPECT_EQ(automatic->streams,
              rows >= big ? LogpClient::kAutoStreamsCalls : 1)
        << rows;
    project.streams = 1;
    std::vector<float> one_y(rows * 5376);
    project.y = one_y.data();
    auto one = (*client)->ProjectChunks(rows_x, rows, project);
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ(one->streams, 1);
    EXPECT_EQ(automatic->determinism_key, one->determinism_key);
    EXPECT_TRUE(y == one_y) << rows;
  }
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

TEST(CliProjectTest, ProjectionThreadsFlagIsCheckedAtStartUp) {
  for (const char* bad :
       {"--projection_threads=-1", "--projection_threads=65"}) {
    auto server = ServerProcess::Start({"--device=cpu", bad});
    ASSERT_FALSE(server.ok()) << bad;
    EXPECT_NE(server.status().message().find(bad), std::string::npos)
        << server.status();
  }
}

TEST(CliProjectTest, MebibyteFlagsAreCheckedAtStartUp) {
  for (const char* bad : {"--max_message_mb=0", "--max_message_mb=2048",
                          "--projection_stream_buffer_mb=0",
                          "--projection_stream_buffer_mb=1099511627776",
                          "--projection_chunk_cache_mb=-1",
                          "--projection_chunk_cache_mb=9223372036854775807"}) {
    auto server = ServerProcess::Start({"--device=cpu", bad});
    ASSERT_FALSE(server.ok()) << bad;
    EXPECT_NE(server.status().message().find(bad), std::string::npos)
        << server.status();
  }
}

// A server that dies while interleaved calls stream ends every call: the
// caller gets an error, no thread is left waiting for a chunk that will
// never come.
TEST(CliProjectTest, InterleavedCallsEndWhenTheServerDies) {
  auto server = ServerProcess::Start({"--device=cpu", "--cpu_threads=1",
                                      "--synthetic_hidden_size=64",
                                      "--synthetic_vocab_size=1000"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int64_t rows = 40000;  // ~0.9 GB of Y: seconds on one CPU thread
  const std::vector<float> x(rows * 96, 0.25f);
  LogpClient::Options options;
  options.target = (*server)->target();
  auto client = LogpClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  LogpClient::ProjectOptions project;
  project.streams = 4;
  project.rows_per_chunk = 64;
  int64_t chunks = 0;
  auto result =
      (*client)->ProjectChunks(x, rows, project, [&](client::ProjectChunk&) {
        if (++chunks == 3) kill((*server)->pid(), SIGKILL);
      });
  EXPECT_FALSE(result.ok());
  EXPECT_LT(chunks, rows / 64);
}

}  // namespace
}  // namespace detlogp
