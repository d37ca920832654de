// detlogp_cli: info | score | check-invariance | project against a server.
//
//   detlogp_cli info --target=127.0.0.1:50051
//   detlogp_cli score --random_rows=4
//   detlogp_cli score --hidden=rows.npy --targets=targets.npy --return_lse
//   detlogp_cli check-invariance --probes=16 --concurrency=32
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "client/invariance_check.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "client/tensor_files.h"
#include "kernels/random_normal.h"
#include "server/models/sha256.h"
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
          "score: N target ids (.npy or .safetensors, int32/int64).");
ABSL_FLAG(std::string, targets_tensor, "target_ids",
          "score: tensor name inside a .safetensors --targets.");
ABSL_FLAG(int, random_rows, 4, "score: random demo rows when no --hidden.");
ABSL_FLAG(uint64_t, seed, 1, "Seed for random rows.");
ABSL_FLAG(float, temperature, 1.0f, "Softmax temperature (0 means 1).");
ABSL_FLAG(bool, return_lse, false, "score: print logsumexp too.");
ABSL_FLAG(int64_t, project_rows, 4096, "project: rows of random X.");
ABSL_FLAG(int64_t, rows_per_chunk, 0, "project: rows per streamed chunk.");
ABSL_FLAG(int, probes, 16, "check-invariance: probe rows.");
ABSL_FLAG(int, concurrency, 32, "check-invariance: concurrent client threads.");
ABSL_FLAG(int, calls_per_thread, 4, "check-invariance: calls per thread.");
ABSL_FLAG(int, channels, 4, "check-invariance: distinct connections.");

namespace {

using detlogp::client::LogpClient;

absl::StatusOr<std::unique_ptr<LogpClient>> Connect() {
  LogpClient::Options options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_token_file));
    std::getline(in, options.bearer_token);
  }
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_tls_ca));
    options.tls_root_certs.assign(std::istreambuf_iterator<char>(in), {});
  }
  return LogpClient::Create(options);
}

int Fail(const absl::Status& status) {
  std::cerr << "error: " << status << "\n";
  return 1;
}

int Info() {
  auto client = Connect();
  if (!client.ok()) return Fail(client.status());
  auto info = (*client)->GetModelInfo();
  if (!info.ok()) return Fail(info.status());
  std::cout << info->DebugString();
  return 0;
}

int Score() {
  auto client = Connect();
  if (!client.ok()) return Fail(client.status());
  auto info = (*client)->GetModelInfo();
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
      return Fail(absl::InvalidArgumentError("--hidden: expected a float [N, H] tensor"));
    }
    dtype = hidden->dtype;
    rows = hidden->shape[0];
    data = std::move(hidden->data);
    if (absl::GetFlag(FLAGS_targets).empty()) {
      return Fail(absl::InvalidArgumentError("--targets is required with --hidden"));
    }
    auto target_file = detlogp::client::ReadTensorFile(
        absl::GetFlag(FLAGS_targets), absl::GetFlag(FLAGS_targets_tensor));
    if (!target_file.ok()) return Fail(target_file.status());
    targets = target_file->integers;
  }
  auto result = (*client)->Score(detlogp::client::MakeLogProbRequest(
      "cli", dtype, rows, info->hidden_size(), std::move(data), targets,
      absl::GetFlag(FLAGS_temperature), absl::GetFlag(FLAGS_return_lse)));
  if (!result.ok()) return Fail(result.status());
  std::cout << "determinism_key " << result->determinism_key << "\n";
  for (int64_t r = 0; r < rows; ++r) {
    std::printf("row %lld target %lld logprob %.9g", static_cast<long long>(r),
                static_cast<long long>(targets[r]), result->logprobs[r]);
    if (!result->lse.empty()) std::printf(" lse %.9g", result->lse[r]);
    std::printf("\n");
  }
  return 0;
}

// Streams the projection of seeded random rows and prints the determinism
// key and a digest of Y's bits: equal digests across servers (CPU or GPU)
// show equal bits.
int Project() {
  auto client = Connect();
  if (!client.ok()) return Fail(client.status());
  const int64_t rows = absl::GetFlag(FLAGS_project_rows);
  detlogp::kernels::RandomNormal random(absl::GetFlag(FLAGS_seed));
  std::vector<float> x(rows * 96);
  for (float& v : x) v = random.Next(1.0f);
  detlogp::server::Sha256 digest;
  const absl::Time start = absl::Now();
  auto result = (*client)->Project(
      x, rows, absl::GetFlag(FLAGS_rows_per_chunk), /*keep_output=*/false,
      [&](const detlogp::v1::ProjectResponse& chunk) {
        digest.Update(chunk.y().data().data(), chunk.y().data().size());
      });
  if (!result.ok()) return Fail(result.status());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("determinism_key %s\ny_sha256 %s\nrows %lld chunks %lld "
              "seconds %.3f output_GB/s %.2f\n",
              result->determinism_key.c_str(), digest.HexDigest().c_str(),
              static_cast<long long>(rows), static_cast<long long>(result->chunks),
              seconds, rows * 5376.0 * 4 / seconds / 1e9);
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
  auto report = detlogp::client::CheckInvariance(options);
  if (!report.ok()) return Fail(report.status());
  std::cout << report->Summary() << "\n";
  return report->ok() ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "detlogp_cli <info|score|check-invariance|project> [--flags]");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << "usage: detlogp_cli <info|score|check-invariance|project> [--flags]\n";
    return 2;
  }
  const std::string command = args[1];
  if (command == "info") return Info();
  if (command == "score") return Score();
  if (command == "check-invariance") return CheckInvariance();
  if (command == "project") return Project();
  std::cerr << "unknown command '" << command << "'\n";
  return 2;
}
