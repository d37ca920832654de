// TLS, mutual TLS and bearer tokens against the real server. Certificates are
// made at test time with openssl.
#include <grpcpp/create_channel.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "client/logp_client.h"
#include "client/model_repository_client.h"
#include "client/random_rows.h"
#include "kernels/bfloat16.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LogpClient;
using testing::ServerProcess;

std::string TestDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A CA, a server certificate for localhost/127.0.0.1 and a client
// certificate, all signed by the CA.
class Certificates {
 public:
  static const Certificates& Get() {
    static const Certificates* certs = new Certificates();
    return *certs;
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string pem(const std::string& name) const {
    return ReadFile(path(name));
  }
  bool ok() const { return ok_; }

 private:
  Certificates() : dir_(TestDir() + "/certs") {
    const std::string d = dir_;
    const std::string script = absl::StrCat(
        "set -e; mkdir -p ", d, "; cd ", d, ";",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
        "-days 1 "
        "-subj /CN=detlogp-test-ca 2>/dev/null;",
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out "
        "server.csr "
        "-subj /CN=localhost 2>/dev/null;",
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext;",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial "
        "-out server.pem -days 1 -extfile san.ext 2>/dev/null;",
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out "
        "client.csr "
        "-subj /CN=client 2>/dev/null;",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial "
        "-out client.pem -days 1 2>/dev/null;",
        "printf '# tokens for tests\\nalpha-token\\n\\nbeta-token\\n' > "
        "tokens.txt");
    ok_ = std::system(script.c_str()) == 0;
  }
  std::string dir_;
  bool ok_ = false;
};

std::unique_ptr<LogpClient> Client(const ServerProcess& server,
                                   LogpClient::Options options) {
  options.target = "localhost:" + std::to_string(server.port());
  options.timeout = absl::Seconds(10);
  return *LogpClient::Create(options);
}

v1::LogProbRequest SmallRequest() {
  return client::MakeLogProbRequest("s", v1::DTYPE_BFLOAT16, 2, 1024,
                                    client::RandomBf16Rows(2, 1024, 3), {1, 2},
                                    1.0f, false);
}

TEST(SecurityTest, TlsServesVerifiedClientsAndRefusesPlaintext) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok()) << "openssl failed";
  auto server = ServerProcess::Start({"--device=cpu",
                                      "--tls_cert=" + certs.path("server.pem"),
                                      "--tls_key=" + certs.path("server.key")});
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options tls;
  tls.tls_root_certs = certs.pem("ca.pem");
  EXPECT_TRUE(Client(**server, tls)->Score(SmallRequest()).ok());
  auto plaintext = Client(**server, {})->Score(SmallRequest());
  EXPECT_EQ(plaintext.status().code(), absl::StatusCode::kUnavailable);
  LogpClient::Options wrong_roots;
  wrong_roots.tls_root_certs = certs.pem("client.pem");  // not a CA
  EXPECT_FALSE(Client(**server, wrong_roots)->Score(SmallRequest()).ok());
  EXPECT_NE((*server)->Log().find("TLS"), std::string::npos);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

// Replicas with TLS reach each other over TLS: a chain push's forward and
// a pull on start, their certificates checked against --peer_tls_ca.
TEST(SecurityTest, ChainPushesAndPullsBetweenTlsReplicasUseTls) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok());
  const std::vector<std::string> tls = {
      "--device=cpu",
      "--synthetic_hidden_size=128",
      "--synthetic_vocab_size=2000",
      "--tls_cert=" + certs.path("server.pem"),
      "--tls_key=" + certs.path("server.key"),
      "--peer_tls_ca=" + certs.path("ca.pem")};
  auto a = ServerProcess::Start(tls, 60);
  auto b = ServerProcess::Start(tls, 60);
  ASSERT_TRUE(a.ok() && b.ok());
  const auto at = [](const ServerProcess& server) {
    return "localhost:" + std::to_string(server.port());
  };
  client::LmHeadUpload upload;
  upload.model = "default";
  upload.hidden_size = 128;
  upload.padded_vocab_size = 2000;
  upload.weight.assign(128 * 2000, kernels::FloatToBf16(0.01f));
  upload.bias.assign(2000, 0.5f);
  LogpClient::Options connection;
  connection.tls_root_certs = certs.pem("ca.pem");
  client::PushOptions chain;
  chain.fanout = client::PushOptions::Fanout::kChain;
  const client::PushReport report =
      client::PushToTargets({at(**a), at(**b)}, connection, {}, upload, chain);
  ASSERT_TRUE(report.status.ok()) << report.status;
  EXPECT_TRUE(report.targets[1].via_chain);  // forwarded by a, over TLS

  std::vector<std::string> joined_flags = tls;
  joined_flags.push_back("--pull_from=" + at(**a));
  auto joined = ServerProcess::Start(joined_flags, 60);
  ASSERT_TRUE(joined.ok()) << joined.status();
  connection.target = at(**joined);
  auto repo = client::ModelRepositoryClient::Create(connection, {});
  ASSERT_TRUE(repo.ok());
  auto models = (*repo)->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->models_size(), 1);
  EXPECT_EQ(models->models(0).model_version(), 2);
  EXPECT_EQ(models->models(0).weights_sha256(),
            client::LmHeadUploadDigest(upload));
}

// A push to a "dns:" name over TLS checks each address against the name's
// certificate: the servers listen on 127.0.0.2 and 127.0.0.3, which the
// certificate (localhost, 127.0.0.1) does not name.
TEST(SecurityTest, DnsTargetPushChecksEachAddressAgainstTheNamesCertificate) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok());
  auto start = [&](const std::string& host) {
    return ServerProcess::Start(
        {"--device=cpu", "--synthetic_hidden_size=128",
         "--synthetic_vocab_size=2000", "--host=" + host,
         "--tls_cert=" + certs.path("server.pem"),
         "--tls_key=" + certs.path("server.key"),
         "--admin_tokens_file=" + certs.path("tokens.txt")},
        60);
  };
  auto a = start("127.0.0.2");
  auto b = start("127.0.0.3");
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<std::string> addresses = {
      absl::StrCat("127.0.0.2:", (*a)->port()),
      absl::StrCat("127.0.0.3:", (*b)->port())};
  client::LmHeadUpload upload;
  upload.model = "default";
  upload.hidden_size = 128;
  upload.padded_vocab_size = 2000;
  upload.weight.assign(128 * 2000, kernels::FloatToBf16(0.02f));
  LogpClient::Options connection;
  connection.tls_root_certs = certs.pem("ca.pem");
  client::ModelRepositoryClient::Options admin;
  admin.timeout = absl::Seconds(20);
  admin.admin_token = "alpha-token";
  // By address alone, the certificate does not match.
  const client::PushReport by_address =
      client::PushToTargets(addresses, connection, admin, upload);
  EXPECT_FALSE(by_address.status.ok());
  for (const client::PushedVersion& refused : by_address.targets) {
    EXPECT_EQ(refused.version.status().code(), absl::StatusCode::kUnavailable)
        << refused.version.status();
  }

  client::PushOptions push;
  push.resolver =
      [&](const std::string& host,
          const std::string&) -> absl::StatusOr<std::vector<std::string>> {
    if (host == "localhost") return addresses;
    return absl::UnavailableError(host);
  };
  const client::PushReport report = client::PushToTargets(
      {"dns:///localhost:50051"}, connection, admin, upload, push);
  ASSERT_TRUE(report.status.ok()) << report.status;
  ASSERT_EQ(report.targets.size(), 2u);
  for (size_t i = 0; i < addresses.size(); ++i) {
    EXPECT_EQ(report.targets[i].target, addresses[i]);
    ASSERT_TRUE(report.targets[i].version.ok());
    EXPECT_EQ(report.targets[i].version->version(), 2);
    EXPECT_EQ(report.targets[i].version->weights_sha256(),
              client::LmHeadUploadDigest(upload));
  }
}

TEST(SecurityTest, MutualTlsRequiresAClientCertificate) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok());
  auto server = ServerProcess::Start(
      {"--device=cpu", "--tls_cert=" + certs.path("server.pem"),
       "--tls_key=" + certs.path("server.key"),
       "--tls_client_ca=" + certs.path("ca.pem")});
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options anonymous;
  anonymous.tls_root_certs = certs.pem("ca.pem");
  EXPECT_FALSE(Client(**server, anonymous)->Score(SmallRequest()).ok());
  LogpClient::Options with_cert = anonymous;
  with_cert.tls_client_cert = certs.pem("client.pem");
  with_cert.tls_client_key = certs.pem("client.key");
  EXPECT_TRUE(Client(**server, with_cert)->Score(SmallRequest()).ok());
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

TEST(SecurityTest, BearerTokensGateEveryRpcButHealth) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok());
  auto server = ServerProcess::Start(
      {"--device=cpu", "--auth_tokens_file=" + certs.path("tokens.txt")});
  ASSERT_TRUE(server.ok()) << server.status();
  for (const std::string token :
       {"", "wrong-token", "alpha-toke", "alpha-token-x"}) {
    LogpClient::Options options;
    options.bearer_token = token;
    auto client = Client(**server, options);
    EXPECT_EQ(client->Score(SmallRequest()).status().code(),
              absl::StatusCode::kUnauthenticated)
        << "'" << token << "'";
    EXPECT_EQ(client->GetModelInfo().status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(client->ScoreStream({SmallRequest()}).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(client->Project(std::vector<float>(96, 1.0f), 1).status().code(),
              absl::StatusCode::kUnauthenticated);
  }
  for (const std::string token : {"alpha-token", "beta-token"}) {
    LogpClient::Options options;
    options.bearer_token = token;
    auto client = Client(**server, options);
    EXPECT_TRUE(client->Score(SmallRequest()).ok()) << token;
    EXPECT_TRUE(client->ScoreStream({SmallRequest(), SmallRequest()}).ok());
    EXPECT_TRUE(client->Project(std::vector<float>(96, 1.0f), 1).ok());
  }
  // Health stays open for probes.
  auto channel = grpc::CreateChannel((*server)->target(),
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(health->Check(&context, {}, &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_NE((*server)->Log().find("bearer tokens required"), std::string::npos);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
}

TEST(SecurityTest, UnixSocketIsPlaintextAndKeepsTheTokens) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok());
  char dir_template[] = "/tmp/detlogp-sec-XXXXXX";  // TEST_TMPDIR is too long
  const std::string socket_dir = ::mkdtemp(dir_template);
  const std::string socket = socket_dir + "/s.sock";
  auto server = ServerProcess::Start(
      {"--device=cpu", "--tls_cert=" + certs.path("server.pem"),
       "--tls_key=" + certs.path("server.key"),
       "--auth_tokens_file=" + certs.path("tokens.txt"),
       "--unix_socket=" + socket});
  ASSERT_TRUE(server.ok()) << server.status();
  LogpClient::Options local;
  local.target = "unix:" + socket;
  local.timeout = absl::Seconds(10);
  local.bearer_token = "alpha-token";
  EXPECT_TRUE((*LogpClient::Create(local))->Score(SmallRequest()).ok());
  local.bearer_token = "";
  EXPECT_EQ((*LogpClient::Create(local))->Score(SmallRequest()).status().code(),
            absl::StatusCode::kUnauthenticated);
  // The TCP port keeps TLS.
  LogpClient::Options plaintext;
  plaintext.bearer_token = "alpha-token";
  EXPECT_EQ(Client(**server, plaintext)->Score(SmallRequest()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_NE((*server)->Log().find("unix:" + socket + " (plaintext)"),
            std::string::npos);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
  ::rmdir(socket_dir.c_str());  // the server removed its socket
}

TEST(SecurityTest, DefaultsBindLoopbackAndRefuseBadTlsFlags) {
  auto server = ServerProcess::Start({"--device=cpu"});
  ASSERT_TRUE(server.ok());
  EXPECT_NE((*server)->Log().find("on 127.0.0.1:"), std::string::npos);
  EXPECT_NE((*server)->Log().find("plaintext, no authentication"),
            std::string::npos);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0);
  auto bad =
      ServerProcess::Start({"--device=cpu", "--tls_cert=/nonexistent.pem"}, 30);
  EXPECT_FALSE(bad.ok());
  auto missing_tokens = ServerProcess::Start(
      {"--device=cpu", "--auth_tokens_file=/nonexistent-tokens"}, 30);
  EXPECT_FALSE(missing_tokens.ok());
}

}  // namespace
}  // namespace detlogp
