// Live weights end to end: the real server binary (CPU backend, small
// lm_heads) with named models and numbered versions, uploaded, loaded and
// unloaded while it serves (docs/live_weights.md), through the C++ clients
// (client/logp_client.h, client/model_repository_client.h) and detlogp_cli.
//
// Bits are compared exactly: an answer names the version it was computed
// with, and must equal that row scored alone, pinned to that version.
#include <dirent.h>
#include <grpcpp/client_context.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/logp_client.h"
#include "client/model_repository_client.h"
#include "client/random_rows.h"
#include "kernels/bfloat16.h"
#include "kernels/random_normal.h"
#include "server/models/lm_head_weights.h"
#include "formats/safetensors.h"
#include "tests/assert_ok.h"
#include "tests/lm_head_test_files.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using client::LmHeadUpload;
using client::LogpClient;
using client::ModelRepositoryClient;
using client::ScoreResult;
using testing::MakeTempDir;
using testing::ServerProcess;
using testing::WriteLmHeadFile;
using v1::ModelVersionStatus;
using v1::UploadModelRequest;

constexpr int64_t kH = 128;
constexpr int64_t kV = 2000;

// ------------------------------------------------------------ helpers

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* entry = readdir(d)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The temporary version directories an upload writes (<root>/<model>/.tmp-*).
std::vector<std::string> TempVersionDirs(const std::string& model_dir) {
  std::vector<std::string> out;
  for (const std::string& name : ListDir(model_dir)) {
    if (absl::StartsWith(name, ".tmp-")) out.push_back(model_dir + "/" + name);
  }
  return out;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// W ~ N(0, 0.05^2) in bf16, bias ~ N(0, 0.1^2): every seed a distinct model.
LmHeadUpload RandomLmHead(const std::string& model, uint64_t seed,
                          int64_t hidden = kH, int64_t vocab = kV,
                          bool with_bias = true) {
  LmHeadUpload upload;
  upload.model = model;
  upload.hidden_size = hidden;
  upload.padded_vocab_size = vocab;
  kernels::RandomNormal random(seed * 7919 + 11);
  upload.weight.resize(vocab * hidden);
  for (uint16_t& w : upload.weight)
    w = kernels::FloatToBf16(random.Next(0.05f));
  if (with_bias) {
    upload.bias.resize(vocab);
    for (float& b : upload.bias) b = random.Next(0.1f);
  }
  return upload;
}

// Fixed hidden rows and targets.
struct Rows {
  int64_t hidden = 0;
  std::string data;  // [n, hidden] bf16
  std::vector<int64_t> targets;

  int64_t size() const { return static_cast<int64_t>(targets.size()); }
  v1::LogProbRequest Request(const std::vector<int>& picks,
                             const std::string& model, int64_t version,
                             const std::string& id = "r") const {
    std::string bytes;
    std::vector<int64_t> picked_targets;
    for (int p : picks) {
      bytes.append(data, p * hidden * 2, hidden * 2);
      picked_targets.push_back(targets[p]);
    }
    return client::MakeLogProbRequest(
        id, v1::DTYPE_BFLOAT16, static_cast<int64_t>(picks.size()), hidden,
        std::move(bytes), picked_targets, 1.0f,
        /*return_lse=*/true, model, version);
  }
  v1::LogProbRequest All(const std::string& model, int64_t version) const {
    std::vector<int> picks(size());
    for (int i = 0; i < size(); ++i) picks[i] = i;
    return Request(picks, model, version, "all");
  }
};

Rows MakeRows(int64_t n, int64_t hidden, int64_t vocab, uint64_t seed) {
  Rows rows;
  rows.hidden = hidden;
  rows.data = client::RandomBf16Rows(n, hidden, seed);
  rows.targets = client::RandomTargets(n, vocab, seed + 1);
  return rows;
}

uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// (logprob bits, lse bits) per row.
using RowBits = std::pair<uint32_t, uint32_t>;
std::vector<RowBits> BitsOf(const ScoreResult& result) {
  std::vector<RowBits> out;
  for (size_t r = 0; r < result.logprobs.size(); ++r) {
    out.push_back({Bits(result.logprobs[r]), Bits(result.lse[r])});
  }
  return out;
}

// The CPU backend in CI; DETLOGP_TEST_DEVICE=cuda:0 runs the same tests on a
// GPU (tools/device/run_suite.sh live-weights).
std::string TestDevice() {
  const char* device = std::getenv("DETLOGP_TEST_DEVICE");
  return device != nullptr ? device : "cpu";
}

std::unique_ptr<ServerProcess> StartServer(std::vector<std::string> args) {
  args.insert(args.begin(),
              {"--device=" + TestDevice(), "--bias_tensor=lm_head.bias"});
  auto server = ServerProcess::Start(args, 60);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

// connections: Options::connections (1: a large call is one request).
std::unique_ptr<LogpClient> Scorer(const ServerProcess& server,
                                   const std::string& token = "",
                                   bool own_connection = false,
                                   int connections = 0) {
  LogpClient::Options options;
  options.target = server.target();
  options.bearer_token = token;
  options.own_connection = own_connection;
  options.connections = connections;
  return *LogpClient::Create(options);
}

std::unique_ptr<ModelRepositoryClient> Repo(const ServerProcess& server,
                                            const std::string& admin_token = "",
                                            int64_t chunk_bytes = 4 << 20) {
  LogpClient::Options connection;
  connection.target = server.target();
  ModelRepositoryClient::Options options;
  options.admin_token = admin_token;
  options.chunk_bytes = chunk_bytes;
  return *ModelRepositoryClient::Create(connection, options);
}

// Each row scored alone, pinned to `version`.
absl::StatusOr<std::vector<RowBits>> SoloBits(LogpClient& client,
                                              const Rows& rows,
                                              const std::string& model,
                                              int64_t version) {
  std::vector<RowBits> out;
  for (int r = 0; r < rows.size(); ++r) {
    auto result = client.Score(rows.Request({r}, model, version, "solo"));
    if (!result.ok()) return result.status();
    if (result->model != model || result->model_version != version) {
      return absl::InternalError(
          absl::StrCat("pinned to ", model, " v", version, ", answered by ",
                       result->model, " v", result->model_version));
    }
    out.push_back(BitsOf(*result)[0]);
  }
  return out;
}

// What ListModels says, without the counts that move (requests in flight).
std::string Summary(const v1::ListModelsResponse& models) {
  std::string out = absl::StrCat("default=", models.default_model(), "\n");
  for (const v1::ModelInfo& info : models.models()) {
    absl::StrAppend(&out, info.model(), " latest=", info.model_version(), "\n");
    for (const ModelVersionStatus& v : info.versions()) {
      absl::StrAppend(&out, "  v", v.version(), " ",
                      ModelVersionStatus::State_Name(v.state()), " ",
                      v.weights_sha256(), " ", v.determinism_key(), " ",
                      v.memory_bytes(), " ", v.source(), "\n");
    }
  }
  return out;
}

std::vector<int64_t> VersionNumbers(const v1::ModelInfo& info) {
  std::vector<int64_t> out;
  for (const ModelVersionStatus& v : info.versions())
    out.push_back(v.version());
  return out;
}

// Writes `messages` on one UploadModel stream (stopping when the server
// ends it), then returns the call's status.
grpc::Status RawUpload(ModelRepositoryClient& repo,
                       const std::vector<UploadModelRequest>& messages) {
  grpc::ClientContext context;
  repo.PrepareContext(&context);
  ModelVersionStatus response;
  auto writer = repo.stub()->UploadModel(&context, &response);
  for (const UploadModelRequest& message : messages) {
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

UploadModelRequest HeaderMessage(const LmHeadUpload& upload) {
  UploadModelRequest message;
  v1::UploadModelHeader* header = message.mutable_header();
  header->set_model(upload.model);
  header->set_dtype(v1::DTYPE_BFLOAT16);
  header->add_shape(upload.padded_vocab_size);
  header->add_shape(upload.hidden_size);
  header->set_vocab_size(upload.vocab_size);
  header->set_has_bias(!upload.bias.empty());
  return message;
}

// The payload (weight bytes, then bias bytes) in `chunk` byte messages.
std::vector<UploadModelRequest> ChunkMessages(const LmHeadUpload& upload,
                                              int64_t chunk = 64 << 10) {
  std::string payload(reinterpret_cast<const char*>(upload.weight.data()),
                      upload.weight.size() * 2);
  payload.append(reinterpret_cast<const char*>(upload.bias.data()),
                 upload.bias.size() * 4);
  std::vector<UploadModelRequest> out;
  for (size_t at = 0; at < payload.size(); at += chunk) {
    out.emplace_back().set_chunk(payload.substr(at, chunk));
  }
  return out;
}

UploadModelRequest DigestMessage(const std::string& digest) {
  UploadModelRequest message;
  message.set_weights_sha256(digest);
  return message;
}

// Sets `stop` and joins the threads however the test body ends (an ASSERT
// returning early must not leave joinable threads behind).
class StopAndJoin {
 public:
  StopAndJoin(std::atomic<bool>* stop, std::vector<std::thread>* threads)
      : stop_(stop), threads_(threads) {}
  ~StopAndJoin() { Now(); }
  void Now() {
    *stop_ = true;
    for (std::thread& thread : *threads_) {
      if (thread.joinable()) thread.join();
    }
  }

 private:
  std::atomic<bool>* stop_;
  std::vector<std::thread>* threads_;
};

bool WaitFor(const std::function<bool()>& condition,
             absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

const ModelVersionStatus* FindVersion(const v1::ModelInfo& info,
                                      int64_t version) {
  for (const ModelVersionStatus& v : info.versions()) {
    if (v.version() == version) return &v;
  }
  return nullptr;
}

// ------------------------------------------------------------ the client

TEST(LiveWeightsClientTest, DigestAndFileConversionMatchTheServers) {
  // The client's digest is the server's (docs/live_weights.md), padding and
  // bias included.
  LmHeadUpload upload = RandomLmHead("m", 3, 64, 1024);
  upload.vocab_size = 1000;
  server::LmHeadWeights weights;
  weights.hidden_size = 64;
  weights.vocab_size = 1000;
  weights.padded_vocab_size = 1024;
  weights.weight.assign(upload.weight.begin(), upload.weight.end());
  weights.bias = upload.bias;
  server::ComputeLmHeadDigest(&weights);
  EXPECT_EQ(client::LmHeadUploadDigest(upload), weights.sha256);

  // An F32 file is rounded to bf16 as the server rounds it (RNE); ties and
  // values that round up are in the data.
  const std::string dir = MakeTempDir("convert");
  const int64_t v = 256, h = 16;
  kernels::RandomNormal random(5);
  std::vector<float> w(v * h);
  for (float& x : w) x = random.Next(0.5f);
  w[0] = 1.00390625f;  // exactly half way between two bf16: rounds to even
  w[1] = 1.01171875f;  // half way, rounds up to even
  std::vector<formats::SafetensorToWrite> tensors(2);
  tensors[0] = {"lm_head.weight", "F32", {v, h}, {}};
  tensors[0].data.resize(w.size() * 4);
  std::memcpy(tensors[0].data.data(), w.data(), w.size() * 4);
  std::vector<uint16_t> bias_half(v);
  for (int64_t i = 0; i < v; ++i)
    bias_half[i] = static_cast<uint16_t>(0x3c00 + i);  // fp16
  tensors[1] = {"lm_head.bias", "F16", {v}, {}};
  tensors[1].data.resize(v * 2);
  std::memcpy(tensors[1].data.data(), bias_half.data(), v * 2);
  ASSERT_OK(formats::WriteSafetensors(dir + "/f32.safetensors", tensors));

  auto read = client::ReadLmHeadUpload("m", dir + "/f32.safetensors",
                                       "lm_head.weight", "lm_head.bias", 200);
  ASSERT_TRUE(read.ok()) << read.status();
  server::LmHeadSource source;
  source.path = dir + "/f32.safetensors";
  source.bias_tensor = "lm_head.bias";
  source.vocab_size = 200;
  auto loaded = server::LoadLmHead(source);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(read->weight, std::vector<uint16_t>(loaded->weight.begin(),
                                                loaded->weight.end()));
  EXPECT_EQ(read->weight[0], 0x3f80);
  EXPECT_EQ(read->weight[1], 0x3f82);
  ASSERT_EQ(read->bias.size(), loaded->bias.size());
  EXPECT_EQ(std::memcmp(read->bias.data(), loaded->bias.data(), v * 4), 0);
  EXPECT_EQ(client::LmHeadUploadDigest(*read), loaded->sha256);

  EXPECT_FALSE(
      client::ReadLmHeadUpload("m", dir + "/f32.safetensors", "nope").ok());
  LmHeadUpload bad = RandomLmHead("m", 1, 60, 100);  // H not a multiple of 8
  EXPECT_EQ(client::ValidateLmHeadUpload(bad).code(),
            absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------ swaps under load

// Client threads score fixed rows against "policy" (its latest version)
// without pause while four new versions are uploaded. Every answer names a
// version; its bits must be that row's solo bits under that version.
TEST(LiveWeightsTest, SwapUnderConcurrentLoadKeepsEveryAnswersBits) {
  const std::string dir = MakeTempDir("swap");
  ASSERT_OK(
      WriteLmHeadFile(dir + "/v1.safetensors", RandomLmHead("policy", 1)));
  auto server =
      StartServer({"--model=policy=" + dir + "/v1.safetensors",
                   "--max_versions_per_model=16", "--max_batch_rows=32"});
  ASSERT_NE(server, nullptr);
  auto repo = Repo(*server, "", 64 << 10);
  const Rows rows = MakeRows(48, kH, kV, 77);

  struct Answer {
    std::vector<int> picks;
    ScoreResult result;
  };
  constexpr int kThreads = 6;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> answered{0};
  std::atomic<int64_t> failed{0};
  absl::Mutex mu;
  std::string first_error;
  std::vector<std::vector<Answer>> answers(kThreads);
  std::vector<std::thread> threads;
  StopAndJoin stop_and_join(&stop, &threads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto client = Scorer(*server, "", /*own_connection=*/t % 2 == 0);
      std::mt19937 rng(1000 + t);
      for (int i = 0; !stop.load(); ++i) {
        const int n = std::uniform_int_distribution<int>(1, 12)(rng);
        std::vector<int> picks(n);
        for (int& p : picks)
          p = std::uniform_int_distribution<int>(0, rows.size() - 1)(rng);
        auto result = client->Score(
            rows.Request(picks, "policy", 0, absl::StrCat(t, "-", i)));
        if (!result.ok()) {
          ++failed;
          absl::MutexLock lock(&mu);
          if (first_error.empty()) first_error = result.status().ToString();
          continue;
        }
        answers[t].push_back({std::move(picks), *std::move(result)});
        ++answered;
      }
    });
  }
  std::map<int64_t, std::string> keys;  // version -> determinism key
  auto info = Scorer(*server)->GetModelInfo("policy");
  ASSERT_TRUE(info.ok()) << info.status();
  keys[1] = info->determinism_key();
  auto wait_answers = [&](int64_t more) {
    const int64_t target = answered.load() + more;
    EXPECT_TRUE(
        WaitFor([&] { return answered.load() >= target; }, absl::Seconds(30)));
  };
  wait_answers(30);
  for (int64_t v = 2; v <= 5; ++v) {
    const LmHeadUpload upload = RandomLmHead("policy", v);
    auto status = repo->UploadModel(upload);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->version(), v);
    EXPECT_EQ(status->weights_sha256(), client::LmHeadUploadDigest(upload));
    EXPECT_EQ(status->state(), ModelVersionStatus::READY);
    keys[v] = status->determinism_key();
    wait_answers(30);
  }
  stop_and_join.Now();
  EXPECT_EQ(failed.load(), 0) << first_error;

  // Every version is still held: score each row alone on each.
  auto client = Scorer(*server);
  std::map<int64_t, std::vector<RowBits>> solo;
  for (int64_t v = 1; v <= 5; ++v) {
    auto bits = SoloBits(*client, rows, "policy", v);
    ASSERT_TRUE(bits.ok()) << bits.status();
    solo[v] = *std::move(bits);
  }
  // The versions really differ, so an answer computed on the wrong one shows.
  for (int r = 0; r < rows.size(); ++r) EXPECT_NE(solo[1][r], solo[2][r]) << r;

  std::set<int64_t> seen;
  int64_t checked = 0, mismatched = 0, wrong_keys = 0;
  for (const auto& thread_answers : answers) {
    for (const Answer& answer : thread_answers) {
      const ScoreResult& result = answer.result;
      ASSERT_EQ(result.model, "policy");
      ASSERT_TRUE(solo.count(result.model_version)) << result.model_version;
      seen.insert(result.model_version);
      wrong_keys += result.determinism_key != keys[result.model_version];
      const std::vector<RowBits> bits = BitsOf(result);
      for (size_t r = 0; r < answer.picks.size(); ++r) {
        ++checked;
        mismatched += bits[r] != solo[result.model_version][answer.picks[r]];
      }
    }
  }
  std::cout << answered.load() << " answers, " << checked
            << " rows checked, versions seen " << absl::StrJoin(seen, ",")
            << "\n";
  EXPECT_EQ(mismatched, 0) << "of " << checked << " rows";
  EXPECT_EQ(wrong_keys, 0);
  EXPECT_EQ(seen.size(), 5u) << "every version should have answered under load";
}

// Requests of 512 rows with --max_batch_rows=16 are cut into 32 slices; new
// versions are published while they are in flight. Each answer must equal
// the same request scored alone on the version the answer names: a request
// whose slices ran on two versions would match neither.
TEST(LiveWeightsTest, MultiSliceRequestNeverMixesVersions) {
  constexpr int64_t kBigH = 256, kBigV = 4096, kRows = 512;
  const std::string dir = MakeTempDir("slices");
  ASSERT_OK(WriteLmHeadFile(dir + "/v1.safetensors",
                            RandomLmHead("policy", 21, kBigH, kBigV)));
  auto server =
      StartServer({"--model=policy=" + dir + "/v1.safetensors",
                   "--max_versions_per_model=8", "--max_batch_rows=16"});
  ASSERT_NE(server, nullptr);
  auto repo = Repo(*server);

  constexpr int kThreads = 3;
  std::vector<Rows> requests;
  for (int t = 0; t < kThreads; ++t)
    requests.push_back(MakeRows(kRows, kBigH, kBigV, 300 + t));
  struct Answer {
    int request;
    absl::Time end;
    ScoreResult result;
  };
  std::atomic<bool> stop{false};
  std::atomic<int64_t> failed{0};
  std::atomic<int64_t> answered{0};
  absl::Mutex mu;
  std::vector<Answer> answers;
  std::vector<std::thread> threads;
  StopAndJoin stop_and_join(&stop, &threads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto client = Scorer(*server, "", /*own_connection=*/true);
      while (!stop.load()) {
        auto result = client->Score(requests[t].All("policy", 0));
        if (!result.ok()) {
          ++failed;
          continue;
        }
        absl::MutexLock lock(&mu);
        answers.push_back({t, absl::Now(), *std::move(result)});
        ++answered;
      }
    });
  }
  std::vector<std::pair<int64_t, absl::Time>> uploads;  // version, returned
  EXPECT_TRUE(
      WaitFor([&] { return answered.load() >= kThreads; }, absl::Seconds(30)));
  for (int64_t v = 2; v <= 4; ++v) {
    const int64_t before = answered.load();
    auto status =
        repo->UploadModel(RandomLmHead("policy", 20 + v, kBigH, kBigV));
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->version(), v);
    uploads.push_back({v, absl::Now()});
    EXPECT_TRUE(
        WaitFor([&] { return answered.load() >= before + 2 * kThreads; },
                absl::Seconds(30)));
  }
  stop_and_join.Now();
  EXPECT_EQ(failed.load(), 0);

  // The pinned solo answers, one request at a time.
  auto client = Scorer(*server);
  std::map<std::pair<int, int64_t>, std::vector<RowBits>> pinned;
  for (int t = 0; t < kThreads; ++t) {
    for (int64_t v = 1; v <= 4; ++v) {
      auto result = client->Score(requests[t].All("policy", v));
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_EQ(result->model_version, v);
      pinned[{t, v}] = BitsOf(*result);
    }
  }
  ASSERT_NE((pinned[{0, 1}]), (pinned[{0, 2}]));
  std::set<int64_t> seen;
  int straddled = 0, mismatched = 0;
  for (const Answer& answer : answers) {
    seen.insert(answer.result.model_version);
    if (BitsOf(answer.result) !=
        pinned[{answer.request, answer.result.model_version}]) {
      ++mismatched;
    }
    // Answered on an older version after the newer one was published (its
    // upload had returned): the publish happened while it was in flight.
    for (const auto& [version, published] : uploads) {
      straddled +=
          answer.result.model_version < version && answer.end > published;
    }
  }
  std::cout << answers.size() << " requests of " << kRows << " rows, "
            << straddled << " in flight while a newer version was published\n";
  EXPECT_EQ(mismatched, 0) << "of " << answers.size();
  EXPECT_EQ(seen.size(), 4u);
  // The test means something only if publishing happened mid-request.
  EXPECT_GT(straddled, 0);
}

// ------------------------------------------------------------ refused uploads

class LiveWeightsStoreTest : public ::testing::Test {
 protected:
  // A server with --model_root and "policy" v1 from a file outside the root.
  void StartWithRoot(std::vector<std::string> extra = {}) {
    dir_ = MakeTempDir("store");
    root_ = dir_ + "/root";
    mkdir(root_.c_str(), 0755);
    v1_ = RandomLmHead("policy", 1);
    ASSERT_OK(WriteLmHeadFile(dir_ + "/v1.safetensors", v1_));
    args_ = {"--model=policy=" + dir_ + "/v1.safetensors",
             "--model_root=" + root_};
    args_.insert(args_.end(), extra.begin(), extra.end());
    server_ = StartServer(args_);
    ASSERT_NE(server_, nullptr);
    rows_ = MakeRows(8, kH, kV, 55);
  }
  void Restart(int signal) {
    // Clients should be gone by now: an idle connection hears the server's
    // GOAWAY only at gRPC's next backup poll (5 s), which SIGTERM awaits.
    server_->Stop(signal);
    server_ = StartServer(args_);
    ASSERT_NE(server_, nullptr);
  }
  std::vector<RowBits> Score(int64_t version, ScoreResult* out = nullptr) {
    auto result = Scorer(*server_)->Score(rows_.All("policy", version));
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return {};
    if (out != nullptr) *out = *result;
    return BitsOf(*result);
  }
  std::string ListSummary() {
    auto models = Repo(*server_)->ListModels();
    EXPECT_TRUE(models.ok()) << models.status();
    return models.ok() ? Summary(*models) : "";
  }

  std::string dir_, root_;
  std::vector<std::string> args_;
  LmHeadUpload v1_;
  std::unique_ptr<ServerProcess> server_;
  Rows rows_;
};

// The client cancels after half the chunks: nothing is published, the old
// version serves the same bits and the temporary directory goes away.
TEST_F(LiveWeightsStoreTest, CancelledUploadChangesNothing) {
  StartWithRoot();
  const std::vector<RowBits> before = Score(0);
  const std::string list_before = ListSummary();
  const std::string model_dir = root_ + "/policy";

  ModelRepositoryClient::UploadHooks hooks;
  bool saw_temp_dir = false;
  hooks.after_chunk = [&](int64_t sent, int64_t total) {
    if (sent < total / 2) return true;
    // The server is writing the version: its temporary directory exists.
    saw_temp_dir = WaitFor([&] { return !TempVersionDirs(model_dir).empty(); });
    return false;
  };
  auto status = Repo(*server_, "", 16 << 10)
                    ->UploadModel(RandomLmHead("policy", 2), hooks);
  EXPECT_EQ(status.status().code(), absl::StatusCode::kCancelled)
      << status.status();
  EXPECT_TRUE(saw_temp_dir);
  EXPECT_TRUE(WaitFor([&] { return TempVersionDirs(model_dir).empty(); }))
      << absl::StrJoin(TempVersionDirs(model_dir), ", ");

  ScoreResult after_result;
  EXPECT_EQ(Score(0, &after_result), before);
  EXPECT_EQ(after_result.model_version, 1);
  EXPECT_EQ(ListSummary(), list_before);
  auto info = Scorer(*server_)->GetModelInfo("policy");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(VersionNumbers(*info), std::vector<int64_t>{1});
  EXPECT_TRUE(ListDir(model_dir).empty())
      << absl::StrJoin(ListDir(model_dir), ", ");
  // The reservation was released: a whole upload still goes through.
  auto next = Repo(*server_)->UploadModel(RandomLmHead("policy", 2));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version(), 2);
}

TEST_F(LiveWeightsStoreTest, BadUploadsAreRefusedNamingTheField) {
  StartWithRoot();
  const std::vector<RowBits> before = Score(0);
  const std::string list_before = ListSummary();
  auto repo = Repo(*server_);
  const LmHeadUpload upload = RandomLmHead("policy", 9);
  const std::string digest = client::LmHeadUploadDigest(upload);
  const std::vector<UploadModelRequest> chunks = ChunkMessages(upload);

  auto expect = [&](const std::string& name,
                    std::vector<UploadModelRequest> messages,
                    grpc::StatusCode code, const std::string& field) {
    const grpc::Status status = RawUpload(*repo, messages);
    EXPECT_EQ(status.error_code(), code)
        << name << ": " << status.error_message();
    EXPECT_TRUE(absl::StartsWith(status.error_message(), field))
        << name << ": " << status.error_message();
  };
  auto with = [&](UploadModelRequest header,
                  std::vector<UploadModelRequest> body,
                  std::vector<UploadModelRequest> tail) {
    std::vector<UploadModelRequest> all = {std::move(header)};
    all.insert(all.end(), body.begin(), body.end());
    all.insert(all.end(), tail.begin(), tail.end());
    return all;
  };

  // A good stream, for reference, is accepted further below.
  expect("wrong digest",
         with(HeaderMessage(upload), chunks,
              {DigestMessage(std::string(64, 'a'))}),
         grpc::StatusCode::DATA_LOSS, "weights_sha256");
  // One flipped byte with the right digest of the original bytes.
  std::vector<UploadModelRequest> flipped = chunks;
  (*flipped[1].mutable_chunk())[7] ^= 1;
  expect("flipped byte",
         with(HeaderMessage(upload), flipped, {DigestMessage(digest)}),
         grpc::StatusCode::DATA_LOSS, "weights_sha256");

  UploadModelRequest three_dims = HeaderMessage(upload);
  three_dims.mutable_header()->add_shape(1);
  expect("3-d shape", with(three_dims, chunks, {DigestMessage(digest)}),
         grpc::StatusCode::INVALID_ARGUMENT, "header.shape");
  UploadModelRequest odd_hidden = HeaderMessage(upload);
  odd_hidden.mutable_header()->set_shape(1, kH - 4);
  expect("H % 8 != 0", with(odd_hidden, chunks, {DigestMessage(digest)}),
         grpc::StatusCode::INVALID_ARGUMENT, "header.shape");
  UploadModelRequest fp32 = HeaderMessage(upload);
  fp32.mutable_header()->set_dtype(v1::DTYPE_FLOAT32);
  expect("fp32", with(fp32, chunks, {DigestMessage(digest)}),
         grpc::StatusCode::INVALID_ARGUMENT, "header.dtype");
  UploadModelRequest bad_name = HeaderMessage(upload);
  bad_name.mutable_header()->set_model("../policy");
  expect("bad name", with(bad_name, chunks, {DigestMessage(digest)}),
         grpc::StatusCode::INVALID_ARGUMENT, "header.model");

  std::vector<UploadModelRequest> too_many = chunks;
  too_many.emplace_back().set_chunk("x");
  expect("one byte too many",
         with(HeaderMessage(upload), too_many, {DigestMessage(digest)}),
         grpc::StatusCode::INVALID_ARGUMENT, "chunk");
  std::vector<UploadModelRequest> too_few(chunks.begin(), chunks.end() - 1);
  expect("one chunk short",
         with(HeaderMessage(upload), too_few, {DigestMessage(digest)}),
         grpc::StatusCode::INVALID_ARGUMENT, "chunk");

  expect("no header",
         with(chunks[0], {chunks.begin() + 1, chunks.end()},
              {DigestMessage(digest)}),
         grpc::StatusCode::INVALID_ARGUMENT, "header");
  expect("empty stream", {}, grpc::StatusCode::INVALID_ARGUMENT, "header");
  expect("no digest", with(HeaderMessage(upload), chunks, {}),
         grpc::StatusCode::INVALID_ARGUMENT, "weights_sha256");

  // Nothing changed, no temporary directory is left, and the same bytes
  // done right are accepted as version 2.
  EXPECT_EQ(Score(0), before);
  EXPECT_EQ(ListSummary(), list_before);
  EXPECT_TRUE(
      WaitFor([&] { return TempVersionDirs(root_ + "/policy").empty(); }));
  const grpc::Status good = RawUpload(
      *repo, with(HeaderMessage(upload), chunks, {DigestMessage(digest)}));
  EXPECT_TRUE(good.ok()) << good.error_message();
  auto info = Scorer(*server_)->GetModelInfo("policy");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->model_version(), 2);
  EXPECT_EQ(info->weights_sha256(), digest);
}

TEST_F(LiveWeightsStoreTest, LoadModelStaysInsideTheModelRoot) {
  StartWithRoot();
  const LmHeadUpload v2 = RandomLmHead("policy", 2);
  mkdir((root_ + "/files").c_str(), 0755);
  ASSERT_OK(WriteLmHeadFile(root_ + "/files/v2.safetensors", v2));
  const std::string outside = dir_ + "/outside";
  mkdir(outside.c_str(), 0755);
  ASSERT_OK(WriteLmHeadFile(outside + "/secret.safetensors", v2));
  ASSERT_EQ(symlink((outside + "/secret.safetensors").c_str(),
                    (root_ + "/files/escape.safetensors").c_str()),
            0);
  ASSERT_EQ(symlink(outside.c_str(), (root_ + "/files/outdir").c_str()), 0);
  const std::string list_before = ListSummary();
  auto repo = Repo(*server_);

  auto load = [&](const std::string& path, const std::string& expected = "") {
    v1::LoadModelRequest request;
    request.set_model("policy");
    request.set_path(path);
    request.set_bias_tensor("lm_head.bias");
    request.set_expected_weights_sha256(expected);
    return repo->LoadModel(request);
  };
  for (const std::string& path :
       {outside + "/secret.safetensors", root_ + "/files/v2.safetensors",
        std::string("../outside/secret.safetensors"),
        std::string("files/../../outside/secret.safetensors"),
        std::string("files/escape.safetensors"),
        std::string("files/outdir/secret.safetensors")}) {
    auto status = load(path);
    EXPECT_EQ(status.status().code(), absl::StatusCode::kPermissionDenied)
        << path << ": " << status.status();
    EXPECT_TRUE(absl::StartsWith(status.status().message(), "path"))
        << status.status();
  }
  EXPECT_EQ(load("files/missing.safetensors").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ListSummary(), list_before);

  const std::string digest = client::LmHeadUploadDigest(v2);
  auto mismatch = load("files/v2.safetensors", std::string(64, '0'));
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument)
      << mismatch.status();
  EXPECT_TRUE(
      absl::StartsWith(mismatch.status().message(), "expected_weights_sha256"))
      << mismatch.status();
  EXPECT_EQ(ListSummary(), list_before);

  auto loaded = load("files/v2.safetensors", digest);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->version(), 2);
  EXPECT_EQ(loaded->weights_sha256(), digest);
  EXPECT_EQ(loaded->source(), "load:files/v2.safetensors");
  // The loaded version serves the same bits as the same weights uploaded.
  ScoreResult on_v2;
  const std::vector<RowBits> loaded_bits = Score(0, &on_v2);
  EXPECT_EQ(on_v2.model_version, 2);
  auto uploaded = repo->UploadModel(v2);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(uploaded->version(), 3);
  EXPECT_EQ(uploaded->determinism_key(), loaded->determinism_key());
  EXPECT_EQ(Score(3), loaded_bits);
}

// ------------------------------------------------------------ admin calls

TEST(LiveWeightsTest, AdminCallsNeedAnAdminToken) {
  const std::string dir = MakeTempDir("admin");
  WriteText(dir + "/scoring.txt", "scoring-token\n");
  WriteText(dir + "/admin.txt", "# operators\nadmin-token\n");
  ASSERT_OK(
      WriteLmHeadFile(dir + "/v1.safetensors", RandomLmHead("policy", 1)));
  auto server = StartServer({"--model=policy=" + dir + "/v1.safetensors",
                             "--auth_tokens_file=" + dir + "/scoring.txt",
                             "--admin_tokens_file=" + dir + "/admin.txt"});
  ASSERT_NE(server, nullptr);
  const LmHeadUpload v2 = RandomLmHead("policy", 2);
  for (const std::string& token :
       {std::string(""), std::string("scoring-token"), std::string("wrong")}) {
    auto repo = Repo(*server, token);
    EXPECT_EQ(repo->ListModels().status().code(),
              absl::StatusCode::kUnauthenticated)
        << token;
    EXPECT_EQ(repo->UploadModel(v2).status().code(),
              absl::StatusCode::kUnauthenticated)
        << token;
    EXPECT_EQ(repo->LoadModel("policy", "x.safetensors").status().code(),
              absl::StatusCode::kUnauthenticated)
        << token;
    EXPECT_EQ(repo->UnloadModel("policy", 1).code(),
              absl::StatusCode::kUnauthenticated)
        << token;
    EXPECT_EQ(repo->CommitVersion("policy", 2, "").status().code(),
              absl::StatusCode::kUnauthenticated)
        << token;
    EXPECT_EQ(repo->AbortVersion("policy", 2).code(),
              absl::StatusCode::kUnauthenticated)
        << token;
  }
  const Rows rows = MakeRows(2, kH, kV, 3);
  // The scoring token scores; nothing changed.
  auto scored = Scorer(*server, "scoring-token")->Score(rows.All("policy", 0));
  ASSERT_TRUE(scored.ok()) << scored.status();
  EXPECT_EQ(scored->model_version, 1);
  {
    auto repo = Repo(*server, "admin-token");
    auto listed = repo->ListModels();
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->models_size(), 1);
    EXPECT_EQ(VersionNumbers(listed->models(0)), std::vector<int64_t>{1});
    auto uploaded = repo->UploadModel(v2);
    ASSERT_TRUE(uploaded.ok()) << uploaded.status();
    EXPECT_EQ(uploaded->version(), 2);
  }
  // The admin token goes only on admin calls; scoring still needs its own.
  EXPECT_EQ(Scorer(*server)->Score(rows.All("policy", 0)).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(server->Stop(SIGTERM), 0);

  // Beyond loopback without admin tokens, every admin call is refused.
  auto open = StartServer(
      {"--host=0.0.0.0", "--model=policy=" + dir + "/v1.safetensors"});
  ASSERT_NE(open, nullptr);
  auto open_repo = Repo(*open);
  EXPECT_EQ(open_repo->ListModels().status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(open_repo->UploadModel(v2).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(open_repo->LoadModel("policy", "x.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(open_repo->UnloadModel("policy", 1).code(),
            absl::StatusCode::kPermissionDenied);
  auto still = Scorer(*open)->Score(rows.All("policy", 0));
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(still->model_version, 1);
  EXPECT_EQ(BitsOf(*still), BitsOf(*scored));
}

// ------------------------------------------------------------ memory bound

TEST_F(LiveWeightsStoreTest, UploadOverTheMemoryBoundIsResourceExhausted) {
  // v1 holds V * (2H + 4) = 520,000 bytes on the CPU; a second such version
  // would make 1,040,000 > 800,000.
  StartWithRoot(
      {"--max_model_memory_bytes=800000", "--max_versions_per_model=4"});
  const std::vector<RowBits> before = Score(0);
  const std::string list_before = ListSummary();
  auto repo = Repo(*server_);
  const LmHeadUpload same_size = RandomLmHead("policy", 2);

  auto refused = repo->UploadModel(same_size);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  // Refused at the header, before any byte: a stream that sends only the
  // header hears RESOURCE_EXHAUSTED, not that it is short.
  const grpc::Status header_only = RawUpload(*repo, {HeaderMessage(same_size)});
  EXPECT_EQ(header_only.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << header_only.error_message();
  auto other_model = repo->UploadModel(RandomLmHead("reference", 3));
  EXPECT_EQ(other_model.status().code(), absl::StatusCode::kResourceExhausted);

  EXPECT_EQ(Score(0), before);
  EXPECT_EQ(ListSummary(), list_before);
  EXPECT_TRUE(
      WaitFor([&] { return TempVersionDirs(root_ + "/policy").empty(); }));
  // Refusals released what they reserved: a model that fits (H=64,
  // V=1000: 132,000 bytes; another shape, so another model) is accepted.
  auto small = repo->UploadModel(RandomLmHead("small", 4, 64, 1000));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->version(), 1);
  EXPECT_EQ(small->memory_bytes(), 132000);
}

// ------------------------------------------------------------ unload

// A long request pinned to version 1 is in flight when UnloadModel(1) is
// called: new requests for v1 are refused at once, the long one finishes
// with v1's bits, and UnloadModel returns only after it.
TEST(LiveWeightsTest, UnloadWaitsForTheVersionsRequests) {
  constexpr int64_t kBigH = 256, kBigV = 8192, kRows = 16384;
  const std::string dir = MakeTempDir("unload");
  ASSERT_OK(WriteLmHeadFile(dir + "/v1.safetensors",
                            RandomLmHead("policy", 1, kBigH, kBigV)));
  auto server = StartServer({"--model=policy=" + dir + "/v1.safetensors",
                             "--max_versions_per_model=4", "--cpu_threads=1"});
  ASSERT_NE(server, nullptr);
  // The long call is one request (not spread over connections): the
  // version then has exactly one request in flight.
  auto scorer = Scorer(*server, "", false, /*connections=*/1);
  ModelRepositoryClient repo(scorer->channel(), {});
  ASSERT_TRUE(repo.UploadModel(RandomLmHead("policy", 2, kBigH, kBigV)).ok());

  const Rows big = MakeRows(kRows, kBigH, kBigV, 8);
  // v1's bits of a sample of the rows, each alone, while v1 is there.
  const std::vector<int> sample = {0, 1, 777, 4096, 9999, kRows - 1};
  std::vector<RowBits> expected;
  for (int r : sample) {
    auto result = scorer->Score(big.Request({r}, "policy", 1));
    ASSERT_TRUE(result.ok()) << result.status();
    expected.push_back(BitsOf(*result)[0]);
  }

  // Written by the threads; declared before the guard that joins them.
  absl::StatusOr<ScoreResult> long_result = absl::UnknownError("not run");
  absl::Time long_done;
  absl::Status unloaded = absl::UnknownError("not run");
  absl::Time unload_done;
  std::atomic<bool> unused_stop{false};
  std::vector<std::thread> threads;
  StopAndJoin join_threads(&unused_stop, &threads);
  threads.emplace_back([&] {
    long_result = scorer->Score(big.All("policy", 1));
    long_done = absl::Now();
  });
  auto v1_status = [&]() -> std::optional<ModelVersionStatus> {
    auto info = scorer->GetModelInfo("policy");
    if (!info.ok()) return std::nullopt;
    const ModelVersionStatus* v1 = FindVersion(*info, 1);
    if (v1 == nullptr) return std::nullopt;
    return *v1;
  };
  EXPECT_TRUE(WaitFor([&] {
    const auto v1 = v1_status();
    return v1.has_value() && v1->requests_in_flight() >= 1;
  }));
  const absl::Time unload_start = absl::Now();
  threads.emplace_back([&] {
    unloaded = repo.UnloadModel("policy", 1);
    unload_done = absl::Now();
  });
  // While it waits: v1 is UNLOADING, still held by the long request, and
  // refused to new ones.
  EXPECT_TRUE(WaitFor([&] {
    const auto v1 = v1_status();
    return v1.has_value() && v1->state() == ModelVersionStatus::UNLOADING;
  }));
  const auto v1 = v1_status();
  ASSERT_TRUE(v1.has_value());
  EXPECT_EQ(v1->requests_in_flight(), 1);
  auto refused = scorer->Score(big.Request({0}, "policy", 1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  auto latest = scorer->Score(big.Request({0}, "policy", 0));
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->model_version, 2);

  join_threads.Now();
  ASSERT_TRUE(long_result.ok()) << long_result.status();
  EXPECT_EQ(long_result->model_version, 1);
  const std::vector<RowBits> bits = BitsOf(*long_result);
  for (size_t i = 0; i < sample.size(); ++i)
    EXPECT_EQ(bits[sample[i]], expected[i]) << sample[i];
  EXPECT_TRUE(unloaded.ok()) << unloaded;
  // The request had time left when the unload began, and the unload
  // returned after it (50 ms for the two answers' delivery).
  EXPECT_GT(long_done - unload_start, absl::Milliseconds(300))
      << "the long request finished too soon to test the wait";
  EXPECT_GE(unload_done, long_done - absl::Milliseconds(50))
      << "UnloadModel returned " << (long_done - unload_done)
      << " before the request";

  auto gone = scorer->GetModelInfo("policy", 1);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(scorer->Score(big.Request({0}, "policy", 1)).status().code(),
            absl::StatusCode::kNotFound);
  auto info = scorer->GetModelInfo("policy");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(VersionNumbers(*info), std::vector<int64_t>{2});
  EXPECT_EQ(repo.UnloadModel("policy", 1).code(), absl::StatusCode::kNotFound);
}

// ------------------------------------------------------------ restarts

// SIGKILL while an upload is half sent: after a restart on the same
// --model_root, the last complete version serves with the same key and
// bits, and the interrupted write is gone.
TEST_F(LiveWeightsStoreTest, KillDuringUploadKeepsTheLastCompleteVersion) {
  StartWithRoot();
  auto v2 = Repo(*server_)->UploadModel(RandomLmHead("policy", 2));
  ASSERT_TRUE(v2.ok()) << v2.status();
  ASSERT_TRUE(v2->persisted());
  ScoreResult before;
  const std::vector<RowBits> bits_before = Score(0, &before);
  ASSERT_EQ(before.model_version, 2);

  const std::string model_dir = root_ + "/policy";
  bool killed = false;
  ModelRepositoryClient::UploadHooks hooks;
  hooks.after_chunk = [&](int64_t sent, int64_t total) {
    if (sent < total / 2) return true;
    // Kill once the server has started the new version's file (it writes
    // whole 16 MiB digest blocks; this model is smaller than one, so the
    // file holds its header so far).
    EXPECT_TRUE(WaitFor([&] {
      const auto temp = TempVersionDirs(model_dir);
      return temp.size() == 1 && FileSize(temp[0] + "/lm_head.safetensors") > 0;
    }));
    server_->Stop(SIGKILL);
    killed = true;
    return false;
  };
  auto interrupted = Repo(*server_, "", 16 << 10)
                         ->UploadModel(RandomLmHead("policy", 3), hooks);
  ASSERT_TRUE(killed);
  EXPECT_FALSE(interrupted.ok());
  EXPECT_EQ(TempVersionDirs(model_dir).size(), 1u)
      << "the kill should leave the write";

  server_ = StartServer(args_);
  ASSERT_NE(server_, nullptr);
  EXPECT_TRUE(TempVersionDirs(model_dir).empty())
      << absl::StrJoin(TempVersionDirs(model_dir), ", ");
  ScoreResult after;
  EXPECT_EQ(Score(0, &after), bits_before);
  EXPECT_EQ(after.model_version, 2);
  EXPECT_EQ(after.determinism_key, before.determinism_key);
  auto info = Scorer(*server_)->GetModelInfo("policy");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->weights_sha256(), v2->weights_sha256());
  EXPECT_TRUE(absl::StartsWith(info->versions(0).source(), "restored:"))
      << info->versions(0).source();
  // Numbering goes on after the restored version.
  auto v3 = Repo(*server_)->UploadModel(RandomLmHead("policy", 3));
  ASSERT_TRUE(v3.ok()) << v3.status();
  EXPECT_EQ(v3->version(), 3);
}

// A clean restart serves the latest uploaded version again, with its
// number, key and bits, in place of the --model flag's file.
TEST_F(LiveWeightsStoreTest, RestartServesTheLatestUploadedVersion) {
  StartWithRoot();
  ASSERT_TRUE(Repo(*server_)->UploadModel(RandomLmHead("policy", 2)).ok());
  auto v3 = Repo(*server_)->UploadModel(RandomLmHead("policy", 3));
  ASSERT_TRUE(v3.ok()) << v3.status();
  ASSERT_EQ(v3->version(), 3);
  ScoreResult before;
  const std::vector<RowBits> bits_before = Score(0, &before);
  ASSERT_EQ(before.model_version, 3);
  // --max_versions_per_model=2 retired v1 (not stored) and keeps v2, v3.
  EXPECT_EQ(ListDir(root_ + "/policy"), (std::vector<std::string>{"2", "3"}));

  Restart(SIGTERM);
  ScoreResult after;
  EXPECT_EQ(Score(0, &after), bits_before);
  EXPECT_EQ(after.model_version, 3);
  EXPECT_EQ(after.determinism_key, before.determinism_key);
  auto info = Scorer(*server_)->GetModelInfo("policy");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->weights_sha256(), v3->weights_sha256());
  EXPECT_NE(info->weights_sha256(), client::LmHeadUploadDigest(v1_));
  EXPECT_NE(server_->Log().find("serving the version restored"),
            std::string::npos);
  // Both kept versions came back (pinned re-scoring survives), on disk.
  EXPECT_EQ(VersionNumbers(*info), (std::vector<int64_t>{2, 3}));
  for (const ModelVersionStatus& v : info->versions())
    EXPECT_TRUE(v.persisted());
  EXPECT_EQ(Scorer(*server_)->Score(rows_.All("policy", 1)).status().code(),
            absl::StatusCode::kNotFound);
  auto v4 = Repo(*server_)->UploadModel(RandomLmHead("policy", 4));
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(v4->version(), 4);
}

// ------------------------------------------------------------ names

TEST(LiveWeightsTest, UnknownModelOrVersionIsNotFoundNamingIt) {
  const std::string dir = MakeTempDir("names");
  const LmHeadUpload v1 = RandomLmHead("policy", 1);
  ASSERT_OK(WriteLmHeadFile(dir + "/v1.safetensors", v1));
  auto server = StartServer({"--model=policy=" + dir + "/v1.safetensors"});
  ASSERT_NE(server, nullptr);
  auto client = Scorer(*server);
  auto repo = Repo(*server);
  const LmHeadUpload v2 = RandomLmHead("policy", 2);
  auto uploaded = repo->UploadModel(v2);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  const Rows rows = MakeRows(2, kH, kV, 1);

  auto unknown_model = client->Score(rows.All("nope", 0));
  EXPECT_EQ(unknown_model.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StartsWith(unknown_model.status().message(), "model:"))
      << unknown_model.status();
  EXPECT_TRUE(absl::StrContains(unknown_model.status().message(), "nope"));
  auto unknown_version = client->Score(rows.All("policy", 99));
  EXPECT_EQ(unknown_version.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(
      absl::StartsWith(unknown_version.status().message(), "model_version:"))
      << unknown_version.status();
  EXPECT_TRUE(absl::StrContains(unknown_version.status().message(), "99"));
  EXPECT_EQ(client->Score(rows.All("policy", -1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->GetModelInfo("nope").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client->GetModelInfo("policy", 99).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(repo->UnloadModel("nope", 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(repo->UnloadModel("policy", 99).code(),
            absl::StatusCode::kNotFound);

  // GetModelInfo: the version asked for (default: the latest), every version.
  auto latest = client->GetModelInfo("policy");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->model(), "policy");
  EXPECT_EQ(latest->model_version(), 2);
  EXPECT_EQ(latest->weights_sha256(), client::LmHeadUploadDigest(v2));
  EXPECT_EQ(latest->determinism_key(), uploaded->determinism_key());
  ASSERT_EQ(VersionNumbers(*latest), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(latest->versions(0).weights_sha256(),
            client::LmHeadUploadDigest(v1));
  EXPECT_EQ(latest->versions(0).state(), ModelVersionStatus::READY);
  EXPECT_EQ(latest->versions(1).source(), "upload");
  EXPECT_NE(latest->versions(0).determinism_key(),
            latest->versions(1).determinism_key());
  auto first = client->GetModelInfo("policy", 1);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->model_version(), 1);
  EXPECT_EQ(first->weights_sha256(), client::LmHeadUploadDigest(v1));
  // The default model is the first --model; an empty model means it.
  auto by_default = client->Score(rows.All("", 0));
  ASSERT_TRUE(by_default.ok());
  EXPECT_EQ(by_default->model, "policy");
  EXPECT_EQ(by_default->model_version, 2);
}

// ------------------------------------------------------------ two models

// policy and reference side by side, scored alternately from several
// threads: each answer equals what a server holding only that model says.
TEST(LiveWeightsTest, TwoModelsSideBySideGiveEachModelsOwnBits) {
  const std::string dir = MakeTempDir("two");
  ASSERT_OK(
      WriteLmHeadFile(dir + "/policy.safetensors", RandomLmHead("policy", 31)));
  ASSERT_OK(WriteLmHeadFile(dir + "/reference.safetensors",
                            RandomLmHead("reference", 32)));
  auto both =
      StartServer({"--model=policy=" + dir + "/policy.safetensors",
                   "--model=reference=" + dir + "/reference.safetensors"});
  ASSERT_NE(both, nullptr);
  std::map<std::string, std::unique_ptr<ServerProcess>> alone;
  for (const std::string name : {"policy", "reference"}) {
    alone[name] =
        StartServer({"--weights=" + dir + "/" + name + ".safetensors"});
    ASSERT_NE(alone[name], nullptr);
  }
  const Rows rows = MakeRows(24, kH, kV, 41);
  std::map<std::string, std::vector<RowBits>> expected;
  std::map<std::string, std::string> keys;
  for (const std::string name : {"policy", "reference"}) {
    auto client = Scorer(*alone[name]);
    auto bits = SoloBits(*client, rows, "default", 1);
    ASSERT_TRUE(bits.ok()) << bits.status();
    expected[name] = *std::move(bits);
    keys[name] = client->GetModelInfo()->determinism_key();
  }
  ASSERT_NE(expected["policy"], expected["reference"]);

  constexpr int kThreads = 4, kCalls = 40;
  std::atomic<int64_t> failed{0}, mismatched{0}, checked{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto client = Scorer(*both, "", t % 2 == 0);
      std::mt19937 rng(t);
      for (int i = 0; i < kCalls; ++i) {
        const std::string name = (i + t) % 2 == 0 ? "policy" : "reference";
        std::vector<int> picks(std::uniform_int_distribution<int>(1, 10)(rng));
        for (int& p : picks)
          p = std::uniform_int_distribution<int>(0, rows.size() - 1)(rng);
        auto result = client->Score(rows.Request(picks, name, 0));
        if (!result.ok() || result->model != name ||
            result->determinism_key != keys[name]) {
          ++failed;
          continue;
        }
        const std::vector<RowBits> bits = BitsOf(*result);
        for (size_t r = 0; r < picks.size(); ++r) {
          ++checked;
          mismatched += bits[r] != expected[name][picks[r]];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(mismatched.load(), 0) << "of " << checked.load();
  auto listed = Repo(*both)->ListModels();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->default_model(), "policy");
  ASSERT_EQ(listed->models_size(), 2);
  EXPECT_EQ(listed->models(0).model(), "policy");
  EXPECT_EQ(listed->models(1).model(), "reference");
}

// ------------------------------------------------------------ push, CLI

TEST(LiveWeightsTest, PushToTargetsUploadsToEveryReplica) {
  const std::string dir = MakeTempDir("push");
  ASSERT_OK(
      WriteLmHeadFile(dir + "/v1.safetensors", RandomLmHead("policy", 1)));
  auto a = StartServer({"--model=policy=" + dir + "/v1.safetensors"});
  auto b = StartServer({"--model=policy=" + dir + "/v1.safetensors"});
  ASSERT_TRUE(a != nullptr && b != nullptr);
  // b is one version ahead: the push numbers the version one above the
  // highest any replica has, the same on both.
  ASSERT_TRUE(Repo(*b)->UploadModel(RandomLmHead("policy", 5)).ok());
  const LmHeadUpload upload = RandomLmHead("policy", 6);
  client::PushReport report = client::PushToTargets(
      {a->target(), b->target()}, LogpClient::Options(), {}, upload);
  ASSERT_TRUE(report.status.ok()) << report.status;
  ASSERT_EQ(report.targets.size(), 2u);
  EXPECT_EQ(report.targets[0].target, a->target());
  ASSERT_TRUE(report.targets[0].version.ok() && report.targets[1].version.ok());
  EXPECT_EQ(report.targets[0].version->version(), 3);
  EXPECT_EQ(report.targets[1].version->version(), 3);
  EXPECT_EQ(report.targets[0].version->determinism_key(),
            report.targets[1].version->determinism_key());
  const Rows rows = MakeRows(4, kH, kV, 2);
  auto on_a = Scorer(*a)->Score(rows.All("policy", 3));
  auto on_b = Scorer(*b)->Score(rows.All("policy", 3));
  ASSERT_TRUE(on_a.ok() && on_b.ok());
  EXPECT_EQ(BitsOf(*on_a), BitsOf(*on_b));

  // The trainer names the number: both replicas publish it as version 10.
  LmHeadUpload named = RandomLmHead("policy", 8);
  named.version = 10;
  report = client::PushToTargets({a->target(), b->target()},
                                 LogpClient::Options(), {}, named);
  ASSERT_TRUE(report.status.ok()) << report.status;
  for (const client::PushedVersion& pushed : report.targets) {
    ASSERT_TRUE(pushed.version.ok()) << pushed.target;
    EXPECT_EQ(pushed.version->version(), 10) << pushed.target;
  }
  on_a = Scorer(*a)->Score(rows.All("policy", 10));
  on_b = Scorer(*b)->Score(rows.All("policy", 10));
  ASSERT_TRUE(on_a.ok() && on_b.ok());
  EXPECT_EQ(BitsOf(*on_a), BitsOf(*on_b));
  // The same number again is refused by both; nothing changes.
  report = client::PushToTargets({a->target(), b->target()},
                                 LogpClient::Options(), {}, named);
  EXPECT_FALSE(report.status.ok());
  for (const client::PushedVersion& pushed : report.targets) {
    EXPECT_EQ(pushed.version.status().code(),
              absl::StatusCode::kFailedPrecondition)
        << pushed.target << ": " << pushed.version.status();
  }
  EXPECT_EQ(Scorer(*a)->GetModelInfo("policy")->model_version(), 10);

  // A replica that is down fails the push, naming it; the push is aborted
  // (two-phase), so the other one still serves what it served.
  const std::string down = b->target();
  EXPECT_EQ(b->Stop(SIGTERM), 0);
  LogpClient::Options connection;
  connection.timeout = absl::Seconds(5);
  ModelRepositoryClient::Options options;
  options.timeout = absl::Seconds(5);
  report = client::PushToTargets({a->target(), down}, connection, options,
                                 RandomLmHead("policy", 7));
  EXPECT_FALSE(report.status.ok());
  EXPECT_TRUE(absl::StrContains(report.status.message(), down))
      << report.status;
  EXPECT_EQ(report.status.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(report.targets[0].version.status().code(),
            absl::StatusCode::kAborted);
  EXPECT_FALSE(report.targets[1].version.ok());
  EXPECT_EQ(Scorer(*a)->GetModelInfo("policy")->model_version(), 10);
}

// detlogp_cli with stderr too (its errors are on stderr).
std::pair<int, std::string> RunCliAll(const std::string& arguments) {
  return testing::RunCli(arguments + " 2>&1");
}

TEST(LiveWeightsTest, CliListsLoadsUploadsScoresAndUnloads) {
  const std::string dir = MakeTempDir("cli");
  const std::string root = dir + "/root";
  mkdir(root.c_str(), 0755);
  mkdir((root + "/files").c_str(), 0755);
  ASSERT_OK(
      WriteLmHeadFile(dir + "/v1.safetensors", RandomLmHead("policy", 1)));
  const LmHeadUpload v2 = RandomLmHead("policy", 2);
  ASSERT_OK(WriteLmHeadFile(dir + "/v2.safetensors", v2));
  ASSERT_OK(WriteLmHeadFile(root + "/files/v3.safetensors",
                            RandomLmHead("policy", 3)));
  WriteText(dir + "/admin.txt", "admin-token\n");
  auto a = StartServer({"--model=policy=" + dir + "/v1.safetensors",
                        "--model_root=" + root,
                        "--admin_tokens_file=" + dir + "/admin.txt",
                        "--max_versions_per_model=4"});
  auto b = StartServer({"--model=policy=" + dir + "/v1.safetensors"});
  ASSERT_TRUE(a != nullptr && b != nullptr);
  const std::string admin = " --admin_token_file=" + dir + "/admin.txt";
  const std::string on_a = " --target=" + a->target();

  // To both servers, numbered 5 on both.
  auto [code, out] = RunCliAll(
      "upload --model=policy --weights_file=" + dir +
      "/v2.safetensors --bias_tensor=lm_head.bias --chunk_mb=1" + admin +
      " --model_version=5 --servers=" + a->target() + "," + b->target());
  EXPECT_EQ(code, 0) << out;
  const std::string digest = client::LmHeadUploadDigest(v2);
  auto key = Scorer(*b)->GetModelInfo("policy", 5);
  ASSERT_TRUE(key.ok()) << out;
  for (const auto& server : {a.get(), b.get()}) {
    EXPECT_TRUE(absl::StrContains(
        out, absl::StrCat("target ", server->target(),
                          " model policy version 5 weights_sha256 ", digest,
                          " determinism_key ", key->determinism_key())))
        << out;
  }
  // --targets means score's target ids, never servers.
  std::tie(code, out) =
      RunCliAll("upload --model=policy --weights_file=" + dir +
                "/v2.safetensors --bias_tensor=lm_head.bias" + admin +
                " --targets=" + a->target());
  EXPECT_NE(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "--servers")) << out;
  std::tie(code, out) =
      RunCliAll("upload --model=policy --weights_file=" + dir +
                "/v2.safetensors --bias_tensor=lm_head.bias" + on_a);
  EXPECT_NE(code, 0) << "no admin token";
  EXPECT_TRUE(absl::StrContains(out, "UNAUTHENTICATED")) << out;
  for (const char* bad : {"--chunk_mb=0", "--chunk_mb=4096"}) {
    std::tie(code, out) = RunCliAll(
        "upload --model=policy --weights_file=" + dir +
        "/v2.safetensors --bias_tensor=lm_head.bias " + bad + admin + on_a);
    EXPECT_NE(code, 0) << bad;
    EXPECT_TRUE(absl::StrContains(out, bad)) << out;
  }

  std::tie(code, out) = RunCliAll(
      "load --model=policy --path=files/v3.safetensors "
      "--bias_tensor=lm_head.bias" +
      admin + on_a);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "version 6 READY")) << out;

  std::tie(code, out) = RunCliAll("models" + admin + on_a);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "model policy latest 6 (default)")) << out;
  for (const char* line :
       {"version 1 READY", "version 5 READY", "version 6 READY",
        "source=load:files/v3.safetensors"}) {
    EXPECT_TRUE(absl::StrContains(out, line)) << line << "\n" << out;
  }

  std::tie(code, out) = RunCliAll(
      "score --random_rows=3 --model=policy --model_version=5" + on_a);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(
      out, "model policy version 5\ndeterminism_key " + key->determinism_key()))
      << out;
  std::tie(code, out) = RunCliAll(
      "check-invariance --probes=4 --concurrency=4 --channels=2 "
      "--model=policy --model_version=1" +
      on_a);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "INVARIANT")) << out;

  std::tie(code, out) =
      RunCliAll("unload --model=policy --model_version=5" + admin + on_a);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "model policy version 5 unloaded")) << out;
  std::tie(code, out) = RunCliAll(
      "score --random_rows=1 --model=policy --model_version=5" + on_a);
  EXPECT_NE(code, 0);
  EXPECT_TRUE(absl::StrContains(out, "NOT_FOUND")) << out;
}

}  // namespace
}  // namespace detlogp
