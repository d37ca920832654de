// Pushing to a fleet: delta uploads (UPLOAD_ENCODING_XOR_ZSTD) against a
// base version, the fall-back to the whole head for a replica without the
// base, and one version number for every replica of a push, on real server
// processes (CPU backend, small lm_heads; docs/live_weights.md).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/logp_client.h"
#include "client/model_repository_client.h"
#include "client/push_targets.h"
#include "client/random_rows.h"
#include "kernels/bfloat16.h"
#include "kernels/random_normal.h"
#include "detlogp/v1/detlogp.pb.h"
#include "proto/status_details.h"
#include "proto/wire_format.h"
#include "server/transport/upload_forward_stream.h"
#include "tests/assert_ok.h"
#include "tests/fleet_test_heads.h"
#include "tests/lm_head_test_files.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LmHeadDelta;
using client::LmHeadUpload;
using client::LogpClient;
using client::ModelRepositoryClient;
using testing::BytesReceived;
using testing::Latest;
using testing::MakeTempDir;
using testing::RandomLmHead;
using testing::Repo;
using testing::ServerProcess;
using testing::Step;
using testing::WriteLmHeadFile;

constexpr int64_t kH = testing::kFleetHidden;
constexpr int64_t kV = testing::kFleetVocab;

std::unique_ptr<ServerProcess> StartServer(std::vector<std::string> args) {
  args.insert(args.begin(), {"--device=cpu", "--bias_tensor=lm_head.bias",
                             "--max_versions_per_model=4"});
  auto server = ServerProcess::Start(args, 60);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

// (logprob bits, lse bits) of fixed rows scored on `version`.
std::vector<std::pair<uint32_t, uint32_t>> ScoredBits(
    const ServerProcess& server, int64_t version) {
  LogpClient::Options options;
  options.target = server.target();
  auto client = *LogpClient::Create(options);
  const int64_t rows = 8;
  auto result = client->Score(client::MakeLogProbRequest(
      "bits", v1::DTYPE_BFLOAT16, rows, kH, client::RandomBf16Rows(rows, kH, 3),
      client::RandomTargets(rows, kV, 4), 1.0f, /*return_lse=*/true, "policy",
      version));
  EXPECT_TRUE(result.ok()) << result.status();
  std::vector<std::pair<uint32_t, uint32_t>> out;
  if (!result.ok()) return out;
  EXPECT_EQ(result->model_version, version);
  for (size_t r = 0; r < result->logprobs.size(); ++r) {
    uint32_t lp, lse;
    std::memcpy(&lp, &result->logprobs[r], 4);
    std::memcpy(&lse, &result->lse[r], 4);
    out.push_back({lp, lse});
  }
  return out;
}

class FleetUploadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("fleet");
    base_ = RandomLmHead(1);
    ASSERT_OK(WriteLmHeadFile(dir_ + "/v1.safetensors", base_));
    step_ = Step(base_, 2);
    ASSERT_OK(WriteLmHeadFile(dir_ + "/v2.safetensors", step_));
  }

  std::unique_ptr<ServerProcess> StartWithBase() {
    return StartServer(
        {"--model=policy=" + dir_ + "/v1.safetensors", "--metrics_port=0"});
  }

  std::string dir_;
  LmHeadUpload base_;
  LmHeadUpload step_;
};

TEST_F(FleetUploadTest, DeltaPublishesTheBitsOfAFullUpload) {
  auto by_delta = StartWithBase();
  auto by_head = StartWithBase();
  ASSERT_TRUE(by_delta != nullptr && by_head != nullptr);
  auto delta = client::EncodeLmHeadDelta(step_, base_, /*base_version=*/1);
  ASSERT_TRUE(delta.ok()) << delta.status();
  // ~4% of the elements changed: the delta is a small part of the head.
  EXPECT_LT(static_cast<int64_t>(delta->bytes.size()),
            step_.payload_bytes() * 6 / 100)
      << delta->bytes.size();

  auto from_delta = Repo(*by_delta)->UploadDelta(step_, *delta);
  ASSERT_TRUE(from_delta.ok()) << from_delta.status();
  auto from_head = Repo(*by_head)->UploadModel(step_);
  ASSERT_TRUE(from_head.ok()) << from_head.status();
  EXPECT_EQ(from_delta->version(), 2);
  EXPECT_EQ(from_delta->weights_sha256(), client::LmHeadUploadDigest(step_));
  EXPECT_EQ(from_delta->weights_sha256(), from_head->weights_sha256());
  EXPECT_EQ(from_delta->determinism_key(), from_head->determinism_key());
  EXPECT_EQ(ScoredBits(*by_delta, 2), ScoredBits(*by_head, 2));
  EXPECT_NE(ScoredBits(*by_delta, 1), ScoredBits(*by_delta, 2));
  // The wire bytes are counted as they came, from the pusher.
  EXPECT_EQ(BytesReceived(*by_delta, "pusher"),
            static_cast<double>(delta->bytes.size()));
  EXPECT_EQ(BytesReceived(*by_head, "pusher"),
            static_cast<double>(step_.payload_bytes()));
  EXPECT_EQ(BytesReceived(*by_delta, "peer"), 0.0);

  // A chain of deltas: version 3 against version 2, itself rebuilt.
  const LmHeadUpload third = Step(step_, 3);
  auto next = client::EncodeLmHeadDelta(third, step_, 2);
  ASSERT_TRUE(next.ok()) << next.status();
  auto v3 = Repo(*by_delta)->UploadDelta(third, *next);
  ASSERT_TRUE(v3.ok()) << v3.status();
  EXPECT_EQ(v3->weights_sha256(), client::LmHeadUploadDigest(third));
}

TEST_F(FleetUploadTest, MissingOrWrongBaseIsBaseMissingAndThePushSendsTheHead) {
  auto with_base = StartWithBase();
  // Started from other weights: its version 1 is not the delta's base.
  const LmHeadUpload other = RandomLmHead(9);
  ASSERT_OK(WriteLmHeadFile(dir_ + "/other.safetensors", other));
  auto without_base =
      StartServer({"--model=policy=" + dir_ + "/other.safetensors"});
  ASSERT_TRUE(with_base != nullptr && without_base != nullptr);
  auto delta = client::EncodeLmHeadDelta(step_, base_, 1);
  ASSERT_TRUE(delta.ok()) << delta.status();

  auto refused = Repo(*without_base)->UploadDelta(step_, *delta);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(v1::DetailsOf(refused.status()).reason, v1::kReasonBaseMissing)
      << refused.status();
  EXPECT_EQ(v1::DetailsOf(refused.status()).fields,
            std::vector<std::string>{"header.base_version"});
  // A version number the server has never had.
  LmHeadDelta absent = *delta;
  absent.base_version = 7;
  refused = Repo(*with_base)->UploadDelta(step_, absent);
  EXPECT_EQ(v1::DetailsOf(refused.status()).reason, v1::kReasonBaseMissing)
      << refused.status();
  EXPECT_EQ(Latest(*with_base), 1);
  EXPECT_EQ(Latest(*without_base), 1);

  LmHeadUpload named = step_;
  named.version = 5;
  client::PushOptions push;
  push.delta = &*delta;
  const client::PushReport report =
      client::PushToTargets({with_base->target(), without_base->target()},
                            LogpClient::Options(), {}, named, push);
  ASSERT_TRUE(report.status.ok()) << report.status;
  EXPECT_TRUE(report.targets[0].sent_delta);
  EXPECT_EQ(report.targets[0].bytes_sent,
            static_cast<int64_t>(delta->bytes.size()));
  EXPECT_FALSE(report.targets[1].sent_delta);
  // The head, after whatever part of the delta was written before the
  // refusal ended the call.
  EXPECT_GE(report.targets[1].bytes_sent, step_.payload_bytes());
  EXPECT_LE(report.targets[1].bytes_sent,
            step_.payload_bytes() + static_cast<int64_t>(delta->bytes.size()));
  for (const client::PushedVersion& pushed : report.targets) {
    ASSERT_TRUE(pushed.version.ok()) << pushed.target;
    EXPECT_EQ(pushed.version->version(), 5);
    EXPECT_EQ(pushed.version->weights_sha256(),
              client::LmHeadUploadDigest(step_));
  }
  EXPECT_EQ(ScoredBits(*with_base, 5), ScoredBits(*without_base, 5));
}

TEST_F(FleetUploadTest, CorruptedDeltaIsRefusedAndNothingIsPublished) {
  auto server = StartWithBase();
  ASSERT_TRUE(server != nullptr);
  auto delta = client::EncodeLmHeadDelta(step_, base_, 1);
  ASSERT_TRUE(delta.ok()) << delta.status();

  // Bytes flipped inside the frame: zstd's checksum (or its format) fails.
  LmHeadDelta flipped = *delta;
  flipped.bytes[flipped.bytes.size() / 2] ^= 0x5a;
  auto refused = Repo(*server)->UploadDelta(step_, flipped);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss)
      << refused.status();
  // Cut short.
  LmHeadDelta cut = *delta;
  cut.bytes.resize(cut.bytes.size() / 2);
  refused = Repo(*server)->UploadDelta(step_, cut);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss)
      << refused.status();
  // A valid frame that rebuilds other weights than the digest stated.
  auto wrong = client::EncodeLmHeadDelta(Step(base_, 99), base_, 1);
  ASSERT_TRUE(wrong.ok());
  wrong->weights_sha256 = delta->weights_sha256;
  refused = Repo(*server)->UploadDelta(step_, *wrong);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(v1::DetailsOf(refused.status()).fields,
            std::vector<std::string>{"weights_sha256"})
      << refused.status();
  EXPECT_EQ(Latest(*server), 1);

  // The good delta still applies afterwards.
  auto taken = Repo(*server)->UploadDelta(step_, *delta);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(Latest(*server), 2);
}

TEST_F(FleetUploadTest, EveryReplicaPublishesOneNumberForAPush) {
  auto a = StartWithBase();
  auto b = StartWithBase();
  auto c = StartWithBase();
  ASSERT_TRUE(a != nullptr && b != nullptr && c != nullptr);
  // b is two versions ahead of a and c.
  ASSERT_TRUE(Repo(*b)->UploadModel(RandomLmHead(5)).ok());
  ASSERT_TRUE(Repo(*b)->UploadModel(RandomLmHead(6)).ok());
  const std::vector<std::string> fleet = {a->target(), b->target(),
                                          c->target()};
  auto next = client::FleetVersion(fleet, LogpClient::Options(), {}, "policy");
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*next, 4);
  client::PushReport report =
      client::PushToTargets(fleet, LogpClient::Options(), {}, step_);
  ASSERT_TRUE(report.status.ok()) << report.status;
  for (const client::PushedVersion& pushed : report.targets) {
    ASSERT_TRUE(pushed.version.ok()) << pushed.target;
    EXPECT_EQ(pushed.version->version(), 4) << pushed.target;
  }

  // From the command line: a delta against version 4, numbered 5
  // everywhere without naming it.
  const LmHeadUpload third = Step(step_, 3);
  ASSERT_OK(WriteLmHeadFile(dir_ + "/v3.safetensors", third));
  auto [code, out] = testing::RunCli(
      "upload --model=policy --bias_tensor=lm_head.bias --weights_file=" +
      dir_ + "/v3.safetensors --base_version=4 --base_weights_file=" + dir_ +
      "/v2.safetensors --servers=" + a->target() + "," + b->target() + "," +
      c->target() + " 2>&1");
  EXPECT_EQ(code, 0) << out;
  for (const ServerProcess* server : {a.get(), b.get(), c.get()}) {
    EXPECT_TRUE(absl::StrContains(
        out, absl::StrCat("target ", server->target(),
                          " model policy version 5 weights_sha256 ",
                          client::LmHeadUploadDigest(third))))
        << out;
    EXPECT_EQ(Latest(*server), 5);
  }
  EXPECT_TRUE(absl::StrContains(out, "sent delta")) << out;
  EXPECT_FALSE(absl::StrContains(out, "sent head")) << out;
  EXPECT_EQ(ScoredBits(*a, 5), ScoredBits(*c, 5));
}

TEST_F(FleetUploadTest, ChainPushForwardsEachChunkAndRoutesAroundFailures) {
  // A fleet of four; the pusher sends to the first only.
  std::vector<std::unique_ptr<ServerProcess>> fleet;
  std::vector<std::string> targets;
  for (int i = 0; i < 4; ++i) {
    fleet.push_back(StartWithBase());
    ASSERT_TRUE(fleet.back() != nullptr);
    targets.push_back(fleet.back()->target());
  }
  client::PushOptions chain;
  chain.fanout = client::PushOptions::Fanout::kChain;
  client::PushReport report =
      client::PushToTargets(targets, LogpClient::Options(), {}, step_, chain);
  ASSERT_TRUE(report.status.ok()) << report.status;
  for (size_t i = 0; i < targets.size(); ++i) {
    const client::PushedVersion& pushed = report.targets[i];
    ASSERT_TRUE(pushed.version.ok()) << pushed.target;
    EXPECT_EQ(pushed.version->version(), 2);
    EXPECT_EQ(pushed.version->weights_sha256(),
              client::LmHeadUploadDigest(step_));
    EXPECT_EQ(pushed.via_chain, i > 0) << pushed.target;
    // Where its bytes came from: the pusher for the first, a peer after.
    const double payload = static_cast<double>(step_.payload_bytes());
    EXPECT_EQ(BytesReceived(*fleet[i], "pusher"), i == 0 ? payload : 0.0);
    EXPECT_EQ(BytesReceived(*fleet[i], "peer"), i == 0 ? 0.0 : payload);
  }
  EXPECT_EQ(ScoredBits(*fleet[0], 2), ScoredBits(*fleet[3], 2));

  // A delta down the chain; the second server is down. Two-phase (the
  // default): the others stage it (directly, after the chain stopped), then
  // the push is aborted on all of them and none changes what it serves.
  const LmHeadUpload third = Step(step_, 3);
  auto delta = client::EncodeLmHeadDelta(third, step_, 2);
  ASSERT_TRUE(delta.ok()) << delta.status();
  EXPECT_EQ(fleet[1]->Stop(SIGTERM), 0);
  LogpClient::Options connection;
  connection.timeout = absl::Seconds(5);
  ModelRepositoryClient::Options options;
  options.timeout = absl::Seconds(20);
  chain.delta = &*delta;
  LmHeadUpload numbered = third;
  numbered.version = 3;
  report = client::PushToTargets(targets, connection, options, numbered, chain);
  EXPECT_EQ(report.status.code(), absl::StatusCode::kAborted) << report.status;
  EXPECT_TRUE(absl::StrContains(report.status.message(), targets[1]))
      << report.status;
  for (int i : {0, 2, 3}) {
    EXPECT_EQ(report.targets[i].version.status().code(),
              absl::StatusCode::kAborted)
        << report.targets[i].version.status();
    EXPECT_EQ(Latest(*fleet[i]), 2) << targets[i];
  }
  // Without two-phase: the pusher sends to the ones after the dead server
  // directly, each publishes on its own, and the report names the one
  // that failed.
  chain.two_phase = false;
  numbered.version = 4;
  report = client::PushToTargets(targets, connection, options, numbered, chain);
  EXPECT_FALSE(report.status.ok());
  EXPECT_TRUE(absl::StrContains(report.status.message(), targets[1]))
      << report.status;
  EXPECT_FALSE(report.targets[1].version.ok());
  for (int i : {0, 2, 3}) {
    const client::PushedVersion& pushed = report.targets[i];
    ASSERT_TRUE(pushed.version.ok())
        << pushed.target << pushed.version.status();
    EXPECT_EQ(pushed.version->version(), 4);
    EXPECT_EQ(pushed.version->weights_sha256(),
              client::LmHeadUploadDigest(third));
    EXPECT_FALSE(pushed.via_chain) << pushed.target;
    EXPECT_TRUE(pushed.sent_delta) << pushed.target;
  }
}

// How a pusher may frame a chunk on the wire.
enum class Framing {
  kPlain,              // as protobuf writes it
  kUnknownFieldAfter,  // then a field UploadModelRequest does not know
  kPaddedLength,       // its length with a padding byte (valid protobuf)
  kLengthPastTheEnd,   // malformed: more bytes announced than sent
};

std::string FramedChunk(absl::string_view bytes, Framing framing) {
  std::string wire;
  v1::wire::AppendVarint(
      v1::wire::Tag(v1::UploadModelRequest::kChunkFieldNumber,
                    v1::wire::kLengthDelimited),
      &wire);
  std::string length;
  v1::wire::AppendVarint(
      bytes.size() + (framing == Framing::kLengthPastTheEnd ? 10 : 0), &length);
  if (framing == Framing::kPaddedLength) {
    length.back() = static_cast<char>(length.back() | 0x80);
    length.push_back('\0');
  }
  wire += length;
  wire.append(bytes.data(), bytes.size());
  if (framing == Framing::kUnknownFieldAfter) wire += "\x78\x01";  // 15: 1
  return wire;
}

// Uploads `head` as `version` to `first`, which forwards it to `next`; the
// payload goes in chunks framed as `framings` says, one each.
grpc::Status PushFramed(const ServerProcess& first, const ServerProcess& next,
                        const LmHeadUpload& head, int64_t version,
                        const std::vector<Framing>& framings) {
  std::string payload(reinterpret_cast<const char*>(head.weight.data()),
                      head.weight.size() * 2);
  payload.append(reinterpret_cast<const char*>(head.bias.data()),
                 head.bias.size() * 4);
  v1::UploadModelRequest header;
  v1::UploadModelHeader* h = header.mutable_header();
  h->set_model(head.model);
  h->set_dtype(v1::DTYPE_BFLOAT16);
  h->add_shape(head.padded_vocab_size);
  h->add_shape(head.hidden_size);
  h->set_vocab_size(head.vocab_size);
  h->set_has_bias(!head.bias.empty());
  h->set_model_version(version);
  h->set_weights_sha256(client::LmHeadUploadDigest(head));
  h->add_forward_to(next.target());
  std::vector<std::string> messages = {header.SerializeAsString()};
  const size_t piece = payload.size() / framings.size() + 1;
  for (size_t i = 0; i < framings.size(); ++i) {
    messages.push_back(FramedChunk(
        absl::string_view(payload).substr(i * piece, piece), framings[i]));
  }

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(60));
  server::UploadForwardStream stream(
      grpc::CreateChannel(first.target(), grpc::InsecureChannelCredentials()),
      &context);
  for (const std::string& message : messages) {
    grpc::Slice slice(message);
    if (!stream.Write(grpc::ByteBuffer(&slice, 1))) break;
  }
  stream.WritesDone();
  v1::ModelVersionStatus response;
  return stream.Finish(&response);
}

// A chunk reaches the weights, and the next server of a chain, alike in
// every framing protobuf reads; a malformed one is refused, naming `chunk`,
// here and by the next server, which receives it as it came.
TEST_F(FleetUploadTest, ChainTakesEveryValidChunkFramingAndRefusesMalformed) {
  auto first = StartWithBase();
  auto second = StartWithBase();
  ASSERT_TRUE(first != nullptr && second != nullptr);
  const grpc::Status pushed =
      PushFramed(*first, *second, step_, 2,
                 {Framing::kPlain, Framing::kUnknownFieldAfter,
                  Framing::kPaddedLength, Framing::kPlain});
  ASSERT_TRUE(pushed.ok()) << pushed.error_message();
  EXPECT_EQ(Latest(*first), 2);
  EXPECT_EQ(Latest(*second), 2);
  EXPECT_EQ(BytesReceived(*second, "peer"),
            static_cast<double>(step_.payload_bytes()));
  EXPECT_EQ(ScoredBits(*second, 2), ScoredBits(*first, 2));

  const grpc::Status refused =
      PushFramed(*first, *second, Step(step_, 3), 3,
                 {Framing::kPlain, Framing::kLengthPastTheEnd});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "malformed"))
      << refused.error_message();
  const absl::Status details =
      v1::StatusWithDetails(absl::StatusCode::kInvalidArgument,
                            refused.error_message(), refused.error_details());
  EXPECT_EQ(v1::DetailsOf(details).fields, std::vector<std::string>{"chunk"})
      << refused.error_message();
  EXPECT_EQ(Latest(*first), 2);
  EXPECT_EQ(Latest(*second), 2);
}

// A "dns:" target is every address its name resolves to: one push stages
// and commits the version on each (two-phase), and the report names each
// address. The resolver maps a test name to three real servers.
TEST_F(FleetUploadTest, DnsTargetPushReachesEveryAddressOfTheName) {
  auto a = StartWithBase();
  auto b = StartWithBase();
  auto c = StartWithBase();
  ASSERT_TRUE(a != nullptr && b != nullptr && c != nullptr);
  // c is a version ahead: the push is numbered above it everywhere.
  ASSERT_TRUE(Repo(*c)->UploadModel(RandomLmHead(5)).ok());
  std::vector<std::string> addresses = {a->target(), b->target(), c->target()};
  std::sort(addresses.begin(), addresses.end());
  const std::string name = "dns:///replicas.test:50051";
  client::PushOptions push;
  push.resolver =
      [&](const std::string& host,
          const std::string& port) -> absl::StatusOr<std::vector<std::string>> {
    if (host == "replicas.test" && port == "50051") return addresses;
    return absl::UnavailableError(absl::StrCat("no such name ", host));
  };
  for (auto fanout : {client::PushOptions::Fanout::kDirect,
                      client::PushOptions::Fanout::kChain}) {
    push.fanout = fanout;
    const LmHeadUpload next =
        Step(step_, fanout == client::PushOptions::Fanout::kDirect ? 7 : 8);
    const int64_t expected =
        fanout == client::PushOptions::Fanout::kDirect ? 3 : 4;
    client::PushReport report =
        client::PushToTargets({name}, LogpClient::Options(), {}, next, push);
    ASSERT_TRUE(report.status.ok()) << report.status;
    EXPECT_TRUE(report.committed);
    ASSERT_EQ(report.targets.size(), 3u);
    for (size_t i = 0; i < addresses.size(); ++i) {
      const client::PushedVersion& pushed = report.targets[i];
      EXPECT_EQ(pushed.target, addresses[i]);
      EXPECT_EQ(pushed.resolved_from, name);
      ASSERT_TRUE(pushed.version.ok()) << pushed.target;
      EXPECT_EQ(pushed.version->version(), expected);
      EXPECT_EQ(pushed.version->weights_sha256(),
                client::LmHeadUploadDigest(next));
    }
    for (const ServerProcess* server : {a.get(), b.get(), c.get()}) {
      EXPECT_EQ(Latest(*server), expected) << server->target();
      auto models = Repo(*server)->ListModels();
      ASSERT_TRUE(models.ok()) << models.status();
      ASSERT_EQ(models->models_size(), 1);
      EXPECT_EQ(models->models(0).weights_sha256(),
                client::LmHeadUploadDigest(next));
    }
    EXPECT_EQ(ScoredBits(*a, expected), ScoredBits(*c, expected));
  }

  // From the command line, through the system's resolver: a name that
  // resolves to nothing is UNAVAILABLE, named, and no server is sent
  // anything.
  auto [code, out] = testing::RunCli(
      "upload --model=policy --bias_tensor=lm_head.bias --weights_file=" +
      dir_ + "/v2.safetensors --servers=dns:///no-such-host.invalid:1 2>&1");
  EXPECT_NE(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "UNAVAILABLE")) << out;
  EXPECT_TRUE(absl::StrContains(out, "dns:///no-such-host.invalid:1")) << out;
  client::PushReport nowhere =
      client::PushToTargets({a->target(), "dns:///nowhere.test:50051"},
                            LogpClient::Options(), {}, step_, push);
  EXPECT_EQ(nowhere.status.code(), absl::StatusCode::kUnavailable)
      << nowhere.status;
  EXPECT_TRUE(
      absl::StrContains(nowhere.status.message(), "dns:///nowhere.test:50051"))
      << nowhere.status;
  EXPECT_EQ(Latest(*a), 4);
}

TEST(PushTargetsTest, ExpandsDnsTargetsInPlaceAndKeepsEachServerOnce) {
  const client::TargetResolver resolver =
      [](const std::string& host,
         const std::string& port) -> absl::StatusOr<std::vector<std::string>> {
    if (host == "pods.test")
      return std::vector<std::string>{"10.0.0.1:" + port, "10.0.0.2:" + port};
    if (host == "empty.test") return std::vector<std::string>{};
    return absl::UnavailableError("target: " + host + ":" + port +
                                  " did not resolve");
  };
  auto fleet = client::ExpandPushTargets(
      {"10.0.0.9:7", "dns:///pods.test:7", "10.0.0.1:7"}, resolver);
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  ASSERT_EQ(fleet->size(), 3u);
  EXPECT_EQ((*fleet)[0].target, "10.0.0.9:7");
  EXPECT_EQ((*fleet)[0].resolved_from, "");
  EXPECT_EQ((*fleet)[0].tls_name, "");
  EXPECT_EQ((*fleet)[1].target, "10.0.0.1:7");
  EXPECT_EQ((*fleet)[1].resolved_from, "dns:///pods.test:7");
  EXPECT_EQ((*fleet)[1].tls_name, "pods.test");
  EXPECT_EQ((*fleet)[2].target, "10.0.0.2:7");
  for (const std::string target :
       {"dns:///empty.test:7", "dns:///gone.test:7"}) {
    auto refused = client::ExpandPushTargets({"10.0.0.9:7", target}, resolver);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(absl::StrContains(refused.status().message(), target))
        << refused.status();
  }
  EXPECT_EQ(
      client::ExpandPushTargets({"dns:///no-port"}, resolver).status().code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace detlogp
