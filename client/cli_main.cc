// detlogp_cli: scores, checks and manages model versions on a server.
//
//   detlogp_cli info --target=127.0.0.1:50051 [--model=policy
//   --model_version=3] detlogp_cli score --random_rows=4 [--model=policy
//   --model_version=3] detlogp_cli score --hidden=rows.npy
//   --targets=targets.npy --return_lse detlogp_cli score --random_rows=4
//   --entropy --top_k=5 detlogp_cli check-invariance --probes=16
//   --concurrency=32 [--model=policy]
//       [--entropy --top_k=20]
//   detlogp_cli project --project_rows=4096
//
// Model versions (ModelRepositoryService; --admin_token_file when the server
// has --admin_tokens_file):
//   detlogp_cli models
//   detlogp_cli load --model=policy --path=ckpt/step_42.safetensors
//   detlogp_cli upload --model=policy --weights_file=step_42.safetensors
//       [--lm_head_tensor=lm_head.weight --bias_tensor= --vocab_size=0]
//       [--targets=10.0.0.1:50051,10.0.0.2:50051] [--model_version=42]
//   detlogp_cli unload --model=policy --model_version=3
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/heap_retention.h"
#include "client/process_usage.h"
#include "client/invariance_check.h"
#include "client/logp_client.h"
#include "client/model_repository_client.h"
#include "client/random_rows.h"
#include "client/tensor_files.h"
#include "kernels/random_normal.h"
#include "digests/sha256.h"
#include "absl/time/clock.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address.");
ABSL_FLAG(int, timeout_s, 60, "Per-call deadline, seconds.");
ABSL_FLAG(std::string, token_file, "",
          "File whose first line is the bearer token to send.");
ABSL_FLAG(std::string, tls_ca, "", "PEM roots; connect with TLS.");
ABSL_FLAG(std::string, hidden, "",
          "score: [N, H] hidden rows (.npy or .safetensors).");
ABSL_FLAG(std::string, hidden_tensor, "hidden",
          "score: tensor name inside a .safetensors --hidden.");
ABSL_FLAG(std::string, targets, "",
          "score: N target ids (.npy or .safetensors, int32/int64). upload: "
          "the servers to push to, comma-separated (default: --target).");
ABSL_FLAG(std::string, targets_tensor, "target_ids",
          "score: tensor name inside a .safetensors --targets.");
ABSL_FLAG(int, random_rows, 4, "score: random demo rows when no --hidden.");
ABSL_FLAG(uint64_t, seed, 1, "Seed for random rows.");
ABSL_FLAG(float, temperature, 1.0f, "Softmax temperature (0 means 1).");
ABSL_FLAG(bool, return_lse, false, "score: print logsumexp too.");
ABSL_FLAG(bool, entropy, false,
          "score: print each row's entropy (nats) too (\"entropy E\"). "
          "check-invariance: half the mixed calls ask for it, checked too.");
ABSL_FLAG(
    int64_t, top_k, 0,
    "score: print each row's top_k most likely tokens too, in descending "
    "log-prob order (\"top_ids i,j,... top_logprobs a,b,...\"); 0: none, at "
    "most the server's --max_top_k. check-invariance: half the mixed calls "
    "ask for a top-k of 1..top_k, checked as a prefix of the solo list.");
ABSL_FLAG(bool, timing, false,
          "score: also print where the call's time went, on stderr: "
          "\"timing build_us B call_us C server_us S validate_us V queue_us Q "
          "compute_us P transfer_us T requests R path grpc|system_shm\" "
          "(transfer: the call's time not spent on the server, both "
          "directions).");
ABSL_FLAG(bool, shared_memory, false,
          "score: send the rows through a system shared-memory region the "
          "CLI registers (same host, the server's --allow_shared_memory); "
          "falls back to the message when refused, and says why.");
ABSL_FLAG(int64_t, project_rows, 4096, "project: rows of random X.");
ABSL_FLAG(int64_t, rows_per_chunk, 0, "project: rows per streamed chunk.");
ABSL_FLAG(int, project_repeats, 1,
          "project: runs of the same projection in this process, each "
          "reported; runs after the first see a warm heap.");
ABSL_FLAG(int, project_streams, 0,
          "project: Project calls side by side, each on a connection of its "
          "own, the rows going round them in blocks of --rows_per_chunk (512 "
          "when 0); one gRPC stream is read on one thread. 0: 4 calls from "
          "8192 rows on, else 1. Chunks are still hashed in row order; Y's "
          "bits are the same for every value.");
ABSL_FLAG(int64_t, hash_backlog_mb, 1024,
          "project: MiB of Y at most waiting for SHA-256 (hashed on its own "
          "thread); past it the stream waits, and the wait is reported.");
ABSL_FLAG(int64_t, heap_retain_mb, 256,
          "MiB of freed memory malloc keeps for reuse at the top of each heap "
          "instead of returning it to the OS (0: glibc's default, 128 KiB). "
          "Received messages are freed whole; returned memory comes back as "
          "page faults on the next message (docs/perf.md, session 5).");
ABSL_FLAG(bool, malloc_hugepages, true,
          "project: run with glibc's transparent huge pages for the heap (sets "
          "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 and re-executes itself, "
          "unless GLIBC_TUNABLES already names that tunable): a stream's "
          "receive buffers fault in 2 MiB at a time, not 4 KiB "
          "(docs/perf.md, H3 projection streaming, session 13).");
ABSL_FLAG(int, malloc_arenas, 1,
          "glibc malloc arenas (0: glibc's default, 8 per core). One keeps "
          "the stream readers' receive buffers in the main heap, reused "
          "(docs/perf.md, H3 projection streaming, session 13).");
ABSL_FLAG(bool, hash_y, true,
          "project: SHA-256 Y's bits. --nohash_y measures the stream alone "
          "(y_sha256 prints as -; each chunk goes back to gRPC at once).");
ABSL_FLAG(int, probes, 16, "check-invariance: probe rows.");
ABSL_FLAG(int, concurrency, 32, "check-invariance: concurrent client threads.");
ABSL_FLAG(int, calls_per_thread, 4, "check-invariance: calls per thread.");
ABSL_FLAG(int, channels, 4, "check-invariance: distinct connections.");
ABSL_FLAG(std::string, model, "",
          "The model (info, score, check-invariance: empty means the server's "
          "default; load, upload, unload: required).");
ABSL_FLAG(
    int64_t, model_version, 0,
    "info, score, check-invariance: a version of --model (0: the latest); "
    "unload: the version to unload; upload, load: the number to publish "
    "the new version as (0: the model's next; name it when pushing to "
    "several replicas so they number it alike).");
ABSL_FLAG(
    std::string, admin_token_file, "",
    "models, load, upload, unload: file whose first line is the admin "
    "token (the server's --admin_tokens_file); sent only on these calls.");
ABSL_FLAG(std::string, path, "",
          "load: a .safetensors file relative to the server's --model_root.");
ABSL_FLAG(std::string, weights_file, "",
          "upload: a local .safetensors file holding the lm_head (F32/F16 are "
          "rounded to bf16, round-to-nearest-even, before sending).");
ABSL_FLAG(std::string, lm_head_tensor, "lm_head.weight",
          "load, upload: the [V, H] weight tensor's name.");
ABSL_FLAG(std::string, bias_tensor, "",
          "load, upload: the optional [V] bias tensor's name.");
ABSL_FLAG(int64_t, vocab_size, 0,
          "load, upload: the real vocabulary (0: every weight row).");
ABSL_FLAG(std::string, expected_sha256, "",
          "load: refuse unless the file's weights hash to this digest.");
ABSL_FLAG(int64_t, chunk_mb, 4, "upload: MiB per streamed chunk.");

namespace {

using detlogp::client::LogpClient;
using detlogp::client::ModelRepositoryClient;
using detlogp::client::ProcessUsage;

std::string FirstLine(const std::string& path) {
  std::string line;
  if (path.empty()) return line;
  std::ifstream in(path);
  std::getline(in, line);
  return line;
}

LogpClient::Options ConnectionOptions() {
  LogpClient::Options options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.bearer_token = FirstLine(absl::GetFlag(FLAGS_token_file));
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_tls_ca));
    options.tls_root_certs.assign(std::istreambuf_iterator<char>(in), {});
  }
  return options;
}

absl::StatusOr<std::unique_ptr<LogpClient>> Connect() {
  LogpClient::Options options = ConnectionOptions();
  options.system_shared_memory = absl::GetFlag(FLAGS_shared_memory);
  return LogpClient::Create(options);
}

absl::StatusOr<ModelRepositoryClient::Options> AdminOptions() {
  // Checked before it becomes bytes: a huge value would overflow.
  const int64_t chunk_mb = absl::GetFlag(FLAGS_chunk_mb);
  if (chunk_mb < 1 || chunk_mb > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--chunk_mb=", chunk_mb, " is outside [1, 1024]"));
  }
  ModelRepositoryClient::Options options;
  options.admin_token = FirstLine(absl::GetFlag(FLAGS_admin_token_file));
  options.chunk_bytes = chunk_mb << 20;
  return options;
}

absl::StatusOr<std::unique_ptr<ModelRepositoryClient>> ConnectAdmin() {
  auto options = AdminOptions();
  if (!options.ok()) return options.status();
  return ModelRepositoryClient::Create(ConnectionOptions(), *options);
}

int Fail(const absl::Status& status) {
  std::cerr << "error: " << status << "\n";
  return 1;
}

int Info() {
  auto client = Connect();
  if (!client.ok()) return Fail(client.status());
  auto info = (*client)->GetModelInfo(absl::GetFlag(FLAGS_model),
                                      absl::GetFlag(FLAGS_model_version));
  if (!info.ok()) return Fail(info.status());
  std::cout << info->DebugString();
  return 0;
}

int Score() {
  auto client = Connect();
  if (!client.ok()) return Fail(client.status());
  // Shapes of the version asked for; the request is pinned to it, so a
  // version published meanwhile cannot change the shapes under it.
  auto info = (*client)->GetModelInfo(absl::GetFlag(FLAGS_model),
                                      absl::GetFlag(FLAGS_model_version));
  if (!info.ok()) return Fail(info.status());
  detlogp::v1::DType dtype = detlogp::v1::DTYPE_BFLOAT16;
  int64_t rows = 0;
  std::string data;
  std::vector<int64_t> targets;
  if (absl::GetFlag(FLAGS_hidden).empty()) {
    rows = absl::GetFlag(FLAGS_random_rows);
    data = detlogp::client::RandomBf16Rows(rows, info->hidden_size(),
                                           absl::GetFlag(FLAGS_seed));
    targets = detlogp::client::RandomTargets(rows, info->vocab_size(),
                                             absl::GetFlag(FLAGS_seed) + 1);
  } else {
    auto hidden = detlogp::client::ReadTensorFile(
        absl::GetFlag(FLAGS_hidden), absl::GetFlag(FLAGS_hidden_tensor));
    if (!hidden.ok()) return Fail(hidden.status());
    if (hidden->shape.size() != 2 || hidden->data.empty()) {
      return Fail(absl::InvalidArgumentError(
          "--hidden: expected a float [N, H] tensor"));
    }
    dtype = hidden->dtype;
    rows = hidden->shape[0];
    data = std::move(hidden->data);
    if (absl::GetFlag(FLAGS_targets).empty()) {
      return Fail(
          absl::InvalidArgumentError("--targets is required with --hidden"));
    }
    auto target_file = detlogp::client::ReadTensorFile(
        absl::GetFlag(FLAGS_targets), absl::GetFlag(FLAGS_targets_tensor));
    if (!target_file.ok()) return Fail(target_file.status());
    targets = target_file->integers;
  }
  detlogp::client::LogProbOptions options;
  options.temperature = absl::GetFlag(FLAGS_temperature);
  options.return_lse = absl::GetFlag(FLAGS_return_lse);
  options.return_entropy = absl::GetFlag(FLAGS_entropy);
  options.top_k = absl::GetFlag(FLAGS_top_k);
  options.model = info->model();
  options.model_version = info->model_version();
  // The client checks the answer's sizes against the request (N rows, N * k
  // top-k entries); the server checks top_k.
  const absl::Time build_start = absl::Now();
  detlogp::v1::LogProbRequest request = detlogp::client::MakeLogProbRequest(
      "cli", dtype, rows, info->hidden_size(), std::move(data), targets,
      options);
  request.set_return_timing(absl::GetFlag(FLAGS_timing));
  const absl::Time call_start = absl::Now();
  auto result = (*client)->Score(request);
  const absl::Time call_end = absl::Now();
  if (!result.ok()) return Fail(result.status());
  if (absl::GetFlag(FLAGS_shared_memory) && !result->used_shared_memory) {
    std::cerr << "shared memory not used: "
              << (*client)->shared_memory_refusal() << "\n";
  }
  if (absl::GetFlag(FLAGS_timing)) {
    const detlogp::v1::ServerTiming& t = result->server_timing;
    const int64_t call_us = absl::ToInt64Microseconds(call_end - call_start);
    std::cerr << "timing build_us "
              << absl::ToInt64Microseconds(call_start - build_start)
              << " call_us " << call_us << " server_us " << t.total_us()
              << " validate_us " << t.validate_us() << " queue_us "
              << t.queue_us() << " compute_us " << t.compute_us()
              << " transfer_us " << call_us - t.total_us() << " requests "
              << result->requests << " path "
              << (result->used_shared_memory ? "system_shm" : "grpc") << "\n";
  }
  std::cout << "model " << result->model << " version " << result->model_version
            << "\ndeterminism_key " << result->determinism_key << "\n";
  // One line per row of "name value" pairs; a top-k list is one value,
  // comma-separated. %.9g round-trips a float.
  const int64_t k = result->top_k;
  for (int64_t r = 0; r < rows; ++r) {
    std::printf("row %lld target %lld logprob %.9g", static_cast<long long>(r),
                static_cast<long long>(targets[r]), result->logprobs[r]);
    if (!result->lse.empty()) std::printf(" lse %.9g", result->lse[r]);
    if (!result->entropy.empty())
      std::printf(" entropy %.9g", result->entropy[r]);
    if (k > 0) {
      std::printf(" top_ids ");
      for (int64_t j = 0; j < k; ++j) {
        std::printf("%s%lld", j ? "," : "",
                    static_cast<long long>(result->top_ids[r * k + j]));
      }
      std::printf(" top_logprobs ");
      for (int64_t j = 0; j < k; ++j) {
        std::printf("%s%.9g", j ? "," : "", result->top_logprobs[r * k + j]);
      }
    }
    std::printf("\n");
  }
  return 0;
}

// Streams the projection of seeded random rows and prints the determinism
// key and a digest of Y's bits: equal digests across servers (CPU or GPU)
// show equal bits.
// SHA-256 of Y's chunks, in arrival order, on a thread of its own: one core
// hashes at 1.5-2 GB/s (OpenSSL), slower than the stream it would otherwise
// hold up. The receiving thread hands each chunk over as it came from gRPC
// (moved: the hasher holds references to gRPC's receive slices and hashes
// y.data straight from them, no copy). At most max_backlog_bytes wait to be
// hashed (one chunk at least); past that the receiver waits, and the time it
// waited is reported.
class ChunkHasher {
 public:
  explicit ChunkHasher(size_t max_backlog_bytes)
      : max_backlog_bytes_(max_backlog_bytes), thread_([this] { Run(); }) {}
  ~ChunkHasher() { Finish(); }

  // Takes the chunk (its slices; y.data is never copied).
  void Add(detlogp::client::ProjectChunk chunk) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto room = [&] {
      return backlog_bytes_ == 0 || backlog_bytes_ < max_backlog_bytes_;
    };
    if (!room()) {
      const absl::Time wait_start = absl::Now();
      room_.wait(lock, room);
      waited_ += absl::Now() - wait_start;
    }
    backlog_bytes_ += static_cast<size_t>(chunk.y_data_bytes);
    queue_.push_back(std::move(chunk));
    work_.notify_one();
  }

  // Hashes what is queued, stops the thread; the digest as lowercase hex.
  std::string Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      work_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
    if (hex_.empty()) hex_ = digest_.HexDigest();
    return hex_;
  }

  // Valid after Finish: time spent in SHA-256, bytes hashed, and the time
  // the receiving thread waited for room in the backlog.
  absl::Duration hashing() const { return hashing_; }
  int64_t bytes() const { return bytes_; }
  absl::Duration waited() const { return waited_; }

 private:
  void Run() {
    for (;;) {
      detlogp::client::ProjectChunk chunk;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [&] { return done_ || !queue_.empty(); });
        if (queue_.empty()) return;
        chunk = std::move(queue_.front());
        queue_.pop_front();
      }
      const absl::Time start = absl::Now();
      for (absl::string_view piece : chunk.y_data) {
        digest_.Update(piece.data(), piece.size());
      }
      hashing_ += absl::Now() - start;
      bytes_ += chunk.y_data_bytes;
      const size_t hashed = static_cast<size_t>(chunk.y_data_bytes);
      chunk = detlogp::client::ProjectChunk();  // gRPC's slices go back first
      std::lock_guard<std::mutex> lock(mu_);
      backlog_bytes_ -= hashed;
      room_.notify_one();
    }
  }

  const size_t max_backlog_bytes_;
  std::mutex mu_;
  std::condition_variable work_;  // a chunk queued, or done_
  std::condition_variable room_;  // backlog_bytes_ went down
  std::deque<detlogp::client::ProjectChunk> queue_;
  size_t backlog_bytes_ = 0;
  bool done_ = false;
  absl::Duration waited_;  // written by the receiving thread only
  // Written by the hashing thread only; read after the join.
  detlogp::digests::Sha256 digest_;
  absl::Duration hashing_;
  int64_t bytes_ = 0;
  std::string hex_;
  std::thread thread_;  // last: starts once the members above exist
};

// Prints the determinism key and the SHA-256 of Y's bits (the first two
// lines, unchanged: tools/device/run_serve.sh compares them between a GPU
// and a CPU server), then the time of the whole call and, separately, the
// stream's (request sent until the last chunk arrived; hashing runs beside
// it) and SHA-256's, and last the CLI's own CPU time and minor page faults
// per GB of Y (received bytes landing on fresh pages show up there; see
// --heap_retain_mb) with the glibc.malloc.hugetlb it ran with (-: unset;
// --malloc_hugepages). Every timing line holds the word "seconds".
int ProjectOnce(LogpClient& client, const std::vector<float>& x, int64_t rows) {
  const int64_t backlog_mb =
      std::max<int64_t>(0, absl::GetFlag(FLAGS_hash_backlog_mb));
  ChunkHasher hasher(static_cast<size_t>(backlog_mb) << 20);
  const bool hash_y = absl::GetFlag(FLAGS_hash_y);
  absl::Duration first_chunk = absl::InfiniteDuration();
  const ProcessUsage usage_before = ProcessUsage::Now();
  const absl::Time start = absl::Now();
  LogpClient::ProjectOptions options;
  options.rows_per_chunk = absl::GetFlag(FLAGS_rows_per_chunk);
  options.streams = absl::GetFlag(FLAGS_project_streams);
  // Read raw: only each chunk's header is parsed; y.data stays in gRPC's
  // receive slices and is hashed from there.
  auto result = client.ProjectChunks(
      x, rows, options, [&](detlogp::client::ProjectChunk& chunk) {
        if (first_chunk == absl::InfiniteDuration())
          first_chunk = absl::Now() - start;
        if (hash_y) hasher.Add(std::move(chunk));
      });
  const double transfer = absl::ToDoubleSeconds(absl::Now() - start);
  const std::string y_sha256 = hash_y ? hasher.Finish() : "-";
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const ProcessUsage usage = ProcessUsage::Now() - usage_before;
  if (!result.ok()) return Fail(result.status());
  const double output_bytes = rows * 5376.0 * 4;
  const double hashing = absl::ToDoubleSeconds(hasher.hashing());
  std::printf(
      "determinism_key %s\ny_sha256 %s\nrows %lld chunks %lld "
      "seconds %.3f output_GB/s %.2f\n",
      result->determinism_key.c_str(), y_sha256.c_str(),
      static_cast<long long>(rows), static_cast<long long>(result->chunks),
      seconds, output_bytes / seconds / 1e9);
  std::printf(
      "transfer seconds %.3f output_GB/s %.2f first_chunk_seconds %.3f "
      "waited_for_hashing_seconds %.3f streams %d\n",
      transfer, output_bytes / transfer / 1e9,
      result->chunks > 0 ? absl::ToDoubleSeconds(first_chunk) : 0.0,
      absl::ToDoubleSeconds(hasher.waited()), result->streams);
  std::printf("sha256 seconds %.3f GB/s %.2f after_transfer_seconds %.3f\n",
              hashing, hashing > 0 ? hasher.bytes() / hashing / 1e9 : 0.0,
              seconds - transfer);
  const std::optional<std::string> hugetlb =
      detlogp::client::MallocHugePagesTunable(std::getenv("GLIBC_TUNABLES"));
  std::printf(
      "client cpu_seconds %.3f minor_page_faults %lld per_GB %.0f "
      "malloc_hugetlb %s\n",
      usage.cpu_seconds, static_cast<long long>(usage.minor_page_faults),
      output_bytes > 0 ? usage.minor_page_faults / (output_bytes / 1e9) : 0.0,
      hugetlb.value_or("-").c_str());
  return 0;
}

// --project_repeats runs the same projection again in this process, each
// run's lines printed as one run's are: the first run also pays for the
// process's heap growing to a stream's working set (page faults that grow
// with rows_per_chunk); later runs are what a long-lived client sees.
int Project() {
  const int repeats = absl::GetFlag(FLAGS_project_repeats);
  if (repeats < 1) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("project_repeats: ", repeats, ", expected 1 or more")));
  }
  auto client = Connect();
  if (!client.ok()) return Fail(client.status());
  const int64_t rows = absl::GetFlag(FLAGS_project_rows);
  detlogp::kernels::RandomNormal random(absl::GetFlag(FLAGS_seed));
  std::vector<float> x(rows * 96);
  for (float& v : x) v = random.Next(1.0f);
  for (int run = 0; run < repeats; ++run) {
    if (const int rc = ProjectOnce(**client, x, rows); rc != 0) return rc;
  }
  return 0;
}

int CheckInvariance() {
  detlogp::client::InvarianceOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.probes = absl::GetFlag(FLAGS_probes);
  options.concurrency = absl::GetFlag(FLAGS_concurrency);
  options.calls_per_thread = absl::GetFlag(FLAGS_calls_per_thread);
  options.channels = absl::GetFlag(FLAGS_channels);
  options.temperature = absl::GetFlag(FLAGS_temperature);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.model = absl::GetFlag(FLAGS_model);
  options.model_version = absl::GetFlag(FLAGS_model_version);
  options.entropy = absl::GetFlag(FLAGS_entropy);
  options.top_k = absl::GetFlag(FLAGS_top_k);
  auto report = detlogp::client::CheckInvariance(options);
  if (!report.ok()) return Fail(report.status());
  std::cout << report->Summary() << "\n";
  return report->ok() ? 0 : 3;
}

void PrintVersion(const detlogp::v1::ModelVersionStatus& v) {
  std::printf(
      "  version %lld %s H=%lld V=%lld V_pad=%lld bias=%d memory=%lld "
      "in_flight=%lld persisted=%d source=%s\n    weights_sha256 %s\n"
      "    determinism_key %s\n",
      static_cast<long long>(v.version()),
      detlogp::v1::ModelVersionStatus::State_Name(v.state()).c_str(),
      static_cast<long long>(v.hidden_size()),
      static_cast<long long>(v.vocab_size()),
      static_cast<long long>(v.padded_vocab_size()), v.has_bias() ? 1 : 0,
      static_cast<long long>(v.memory_bytes()),
      static_cast<long long>(v.requests_in_flight()), v.persisted() ? 1 : 0,
      v.source().c_str(), v.weights_sha256().c_str(),
      v.determinism_key().c_str());
}

int Models() {
  auto client = ConnectAdmin();
  if (!client.ok()) return Fail(client.status());
  auto models = (*client)->ListModels();
  if (!models.ok()) return Fail(models.status());
  for (const detlogp::v1::ModelInfo& info : models->models()) {
    std::printf("model %s latest %lld%s\n", info.model().c_str(),
                static_cast<long long>(info.model_version()),
                info.model() == models->default_model() ? " (default)" : "");
    for (const auto& version : info.versions()) PrintVersion(version);
  }
  return 0;
}

absl::Status RequireModel() {
  if (absl::GetFlag(FLAGS_model).empty()) {
    return absl::InvalidArgumentError("--model is required");
  }
  return absl::OkStatus();
}

int Load() {
  if (absl::Status s = RequireModel(); !s.ok()) return Fail(s);
  if (absl::GetFlag(FLAGS_path).empty()) {
    return Fail(absl::InvalidArgumentError(
        "--path is required (relative to the server's --model_root)"));
  }
  auto client = ConnectAdmin();
  if (!client.ok()) return Fail(client.status());
  detlogp::v1::LoadModelRequest request;
  request.set_model(absl::GetFlag(FLAGS_model));
  request.set_path(absl::GetFlag(FLAGS_path));
  request.set_lm_head_tensor(absl::GetFlag(FLAGS_lm_head_tensor));
  request.set_bias_tensor(absl::GetFlag(FLAGS_bias_tensor));
  request.set_vocab_size(absl::GetFlag(FLAGS_vocab_size));
  request.set_expected_weights_sha256(absl::GetFlag(FLAGS_expected_sha256));
  request.set_model_version(absl::GetFlag(FLAGS_model_version));
  auto version = (*client)->LoadModel(request);
  if (!version.ok()) return Fail(version.status());
  std::printf("model %s\n", request.model().c_str());
  PrintVersion(*version);
  return 0;
}

// Uploads to --targets (or --target); one line per target.
int Upload() {
  if (absl::Status s = RequireModel(); !s.ok()) return Fail(s);
  if (absl::GetFlag(FLAGS_weights_file).empty()) {
    return Fail(absl::InvalidArgumentError("--weights_file is required"));
  }
  auto upload = detlogp::client::ReadLmHeadUpload(
      absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_weights_file),
      absl::GetFlag(FLAGS_lm_head_tensor), absl::GetFlag(FLAGS_bias_tensor),
      absl::GetFlag(FLAGS_vocab_size));
  if (!upload.ok()) return Fail(upload.status());
  upload->version = absl::GetFlag(FLAGS_model_version);
  std::vector<std::string> targets =
      absl::StrSplit(absl::GetFlag(FLAGS_targets), ',', absl::SkipWhitespace());
  if (targets.empty()) targets.push_back(absl::GetFlag(FLAGS_target));
  auto admin = AdminOptions();
  if (!admin.ok()) return Fail(admin.status());
  const detlogp::client::PushReport report = detlogp::client::PushToTargets(
      targets, ConnectionOptions(), *admin, *upload);
  for (const detlogp::client::PushedVersion& pushed : report.targets) {
    if (pushed.version.ok()) {
      std::printf(
          "target %s model %s version %lld weights_sha256 %s "
          "determinism_key %s\n",
          pushed.target.c_str(), upload->model.c_str(),
          static_cast<long long>(pushed.version->version()),
          pushed.version->weights_sha256().c_str(),
          pushed.version->determinism_key().c_str());
    } else {
      std::printf("target %s error %s\n", pushed.target.c_str(),
                  pushed.version.status().ToString().c_str());
    }
  }
  if (!report.status.ok()) return Fail(report.status);
  return 0;
}

int Unload() {
  if (absl::Status s = RequireModel(); !s.ok()) return Fail(s);
  if (absl::GetFlag(FLAGS_model_version) <= 0) {
    return Fail(
        absl::InvalidArgumentError("--model_version is required (> 0)"));
  }
  auto client = ConnectAdmin();
  if (!client.ok()) return Fail(client.status());
  const absl::Status status = (*client)->UnloadModel(
      absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_model_version));
  if (!status.ok()) return Fail(status);
  std::printf("model %s version %lld unloaded\n",
              absl::GetFlag(FLAGS_model).c_str(),
              static_cast<long long>(absl::GetFlag(FLAGS_model_version)));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr char kUsage[] =
      "detlogp_cli <info|score|check-invariance|project|models|load|upload|"
      "unload> [--flags]";
  absl::SetProgramUsageMessage(kUsage);
  // Abseil's --help and --helpshort list only flags defined in a file named
  // after the program (detlogp_cli.cc); ours live here, in cli_main.cc.
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return file == __FILE__;
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  usage_config.contains_helppackage_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  // Only `project` receives large messages; glibc reads its tunables only
  // when a process starts.
  if (args.size() == 2 && absl::string_view(args[1]) == "project" &&
      absl::GetFlag(FLAGS_malloc_hugepages)) {
    if (const std::optional<std::string> tunables =
            detlogp::client::TunablesWithMallocHugePages(
                std::getenv("GLIBC_TUNABLES"))) {
      setenv("GLIBC_TUNABLES", tunables->c_str(), 1);
      execv("/proc/self/exe", argv);
      std::cerr << "--malloc_hugepages: could not re-execute ("
                << std::strerror(errno) << "); going on with 4 KiB pages\n";
    }
  }
  if (absl::Status s = detlogp::client::RetainFreedHeapMemory(
          absl::GetFlag(FLAGS_heap_retain_mb) * (int64_t{1} << 20));
      !s.ok()) {
    std::cerr << "--heap_retain_mb: " << s << "\n";
    return 2;
  }
  if (absl::Status s = detlogp::client::LimitMallocArenas(
          absl::GetFlag(FLAGS_malloc_arenas));
      !s.ok()) {
    std::cerr << "--malloc_arenas: " << s << "\n";
    return 2;
  }
  if (args.size() != 2) {
    std::cerr << "usage: " << kUsage << "\n";
    return 2;
  }
  const std::string command = args[1];
  if (command == "info") return Info();
  if (command == "score") return Score();
  if (command == "check-invariance") return CheckInvariance();
  if (command == "project") return Project();
  if (command == "models") return Models();
  if (command == "load") return Load();
  if (command == "upload") return Upload();
  if (command == "unload") return Unload();
  std::cerr << "unknown command '" << command << "'\n";
  return 2;
}
