// --unix_socket: the path checks (server/transport/unix_socket.h) and a real
// server answering on the socket with the same bits, key and projection as
// on its TCP port.
#include "server/transport/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using server::PrepareUnixSocketPath;
using testing::ServerProcess;

// Under a fresh directory in /tmp: Bazel's TEST_TMPDIR is longer than a
// socket path may be.
std::string TempPath(const std::string& name) {
  static const std::string* dir = [] {
    char pattern[] = "/tmp/detlogp-uds-XXXXXX";
    return new std::string(::mkdtemp(pattern));
  }();
  return absl::StrCat(*dir, "/", name);
}

bool Exists(const std::string& path) {
  struct stat info;
  return ::lstat(path.c_str(), &info) == 0;
}

// A socket bound at `path`; listening when `listen` is set. Closing it
// leaves the file behind, as a crashed server does.
int BindSocket(const std::string& path, bool listen) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
            0)
      << std::strerror(errno);
  if (listen) {
    EXPECT_EQ(::listen(fd, 4), 0);
  }
  return fd;
}

TEST(UnixSocketPathTest, AnAbsentPathIsFine) {
  const std::string path = TempPath("absent.sock");
  ::unlink(path.c_str());
  EXPECT_TRUE(PrepareUnixSocketPath(path, "--unix_socket").ok());
}

TEST(UnixSocketPathTest, AStaleSocketIsRemoved) {
  const std::string path = TempPath("stale.sock");
  ::unlink(path.c_str());
  ::close(BindSocket(path, /*listen=*/false));
  ASSERT_TRUE(Exists(path));
  EXPECT_TRUE(PrepareUnixSocketPath(path, "--unix_socket").ok());
  EXPECT_FALSE(Exists(path));
}

TEST(UnixSocketPathTest, ALiveSocketIsRefused) {
  const std::string path = TempPath("live.sock");
  ::unlink(path.c_str());
  const int fd = BindSocket(path, /*listen=*/true);
  const absl::Status status = PrepareUnixSocketPath(path, "--unix_socket");
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(absl::StrContains(status.message(), "--unix_socket")) << status;
  EXPECT_TRUE(Exists(path));
  ::close(fd);
  ::unlink(path.c_str());
}

TEST(UnixSocketPathTest, AnotherFileIsRefusedAndKept) {
  const std::string path = TempPath("regular_file");
  std::ofstream(path) << "data";
  const absl::Status status = PrepareUnixSocketPath(path, "--unix_socket");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(status.message(), "not a socket")) << status;
  EXPECT_TRUE(Exists(path));
  ::unlink(path.c_str());
}

TEST(UnixSocketPathTest, APathTooLongForSockaddrIsRefused) {
  const absl::Status status =
      PrepareUnixSocketPath("/tmp/" + std::string(200, 'a'), "--unix_socket");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "--unix_socket")) << status;
  EXPECT_EQ(PrepareUnixSocketPath("", "--unix_socket").code(),
            absl::StatusCode::kInvalidArgument);
}

std::unique_ptr<client::LogpClient> Connect(const std::string& target) {
  client::LogpClient::Options options;
  options.target = target;
  options.max_message_bytes = 256 << 20;
  auto client = client::LogpClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

TEST(UnixSocketServerTest,
     AnswersWithTheTcpPortsBitsAndRemovesItsSocketOnExit) {
  const std::string path = TempPath("server.sock");
  ::unlink(path.c_str());
  auto server = ServerProcess::Start(
      {"--device=cpu", "--cpu_threads=2", "--synthetic_hidden_size=64",
       "--synthetic_vocab_size=1000", "--unix_socket=" + path});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(Exists(path));
  auto over_tcp = Connect((*server)->target());
  auto over_unix = Connect("unix:" + path);
  ASSERT_NE(over_tcp, nullptr);
  ASSERT_NE(over_unix, nullptr);

  client::LogProbOptions extras;
  extras.return_lse = true;
  extras.return_entropy = true;
  extras.top_k = 4;
  const auto request = client::MakeLogProbRequest(
      "rows", v1::DTYPE_BFLOAT16, 33, 64, client::RandomBf16Rows(33, 64, 5),
      client::RandomTargets(33, 1000, 6), extras);
  auto tcp = over_tcp->Score(request);
  auto via_unix = over_unix->Score(request);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  ASSERT_TRUE(via_unix.ok()) << via_unix.status();
  EXPECT_EQ(std::memcmp(tcp->logprobs.data(), via_unix->logprobs.data(),
                        tcp->logprobs.size() * sizeof(float)),
            0);
  EXPECT_EQ(tcp->entropy.size(), via_unix->entropy.size());
  EXPECT_EQ(std::memcmp(tcp->entropy.data(), via_unix->entropy.data(),
                        tcp->entropy.size() * sizeof(float)),
            0);
  EXPECT_EQ(tcp->top_ids, via_unix->top_ids);
  EXPECT_EQ(tcp->determinism_key, via_unix->determinism_key);

  std::vector<float> x(700 * 96);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(i % 97) / 97.0f - 0.5f;
  auto y_tcp = over_tcp->Project(x, 700, 128);
  auto y_unix = over_unix->Project(x, 700, 128);
  ASSERT_TRUE(y_tcp.ok()) << y_tcp.status();
  ASSERT_TRUE(y_unix.ok()) << y_unix.status();
  EXPECT_EQ(y_unix->chunks, 6);
  EXPECT_EQ(y_tcp->y, y_unix->y);
  EXPECT_EQ(y_tcp->determinism_key, y_unix->determinism_key);

  // A second server on the same path is refused and leaves the first's
  // socket alone.
  auto second = ServerProcess::Start(
      {"--device=cpu", "--synthetic_hidden_size=64",
       "--synthetic_vocab_size=1000", "--unix_socket=" + path},
      /*timeout_s=*/20);
  EXPECT_FALSE(second.ok());
  EXPECT_TRUE(over_unix->Score(request).ok());

  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
  EXPECT_TRUE(absl::StrContains((*server)->Log(), "unix:" + path));
  EXPECT_FALSE(Exists(path));
}

}  // namespace
}  // namespace detlogp
