// detlogp_cli: scores, checks and manages model versions on a server. The
// flags live here and are copied into each command's Options (cli_score.h,
// cli_project.h, cli_models.h); --help lists them all.
//
//   detlogp_cli info --target=127.0.0.1:50051 [--model=policy]
//   detlogp_cli score --random_rows=4 [--model=policy --model_version=3]
//   detlogp_cli score --hidden=rows.npy --targets=targets.npy --return_lse
//   detlogp_cli score --random_rows=4 --entropy --top_k=5
//   detlogp_cli score --random_rows=65536 --cuda_shared_memory --timing
//   detlogp_cli check-invariance --probes=16 --concurrency=32
//   detlogp_cli project --project_rows=4096 [--project_malloc_tuning]
//
// Model versions (ModelRepositoryService; --admin_token_file when the server
// has --admin_tokens_file):
//   detlogp_cli models
//   detlogp_cli load --model=policy --path=ckpt/step_42.safetensors
//   detlogp_cli upload --model=policy --weights_file=/ckpt/step_42
//       [--servers=10.0.0.1:50051,10.0.0.2:50051] [--model_version=42]
//       [--base_version=41 --base_weights_file=/ckpt/step_41]
//   detlogp_cli unload --model=policy --model_version=3
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli_models.h"
#include "client/cli_project.h"
#include "client/cli_score.h"
#include "client/heap_retention.h"
#include "client/invariance_check.h"
#include "client/logp_client.h"
#include "client/model_repository_client.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "Server address; dns:///name:port: every address the name "
          "resolves to is a replica (score's requests spread over them).");
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
          "compute_us P transfer_us T requests R connections N path "
          "grpc|system_shm|cuda_shm\" (build: making the request, or "
          "uploading the rows to the GPU with --cuda_shared_memory; "
          "transfer: the call's time not spent on the server, both "
          "directions).");
ABSL_FLAG(bool, shared_memory, false,
          "score: send the rows through a system shared-memory region the "
          "CLI registers (same host, the server's --allow_shared_memory); "
          "falls back to the message when refused, and says why.");
ABSL_FLAG(bool, cuda_shared_memory, false,
          "score: upload the rows (--random_rows or --hidden) to "
          "--cuda_device once, then score them from there through a CUDA "
          "region the CLI registers (bf16 rows; same host, the server's "
          "--allow_shared_memory, a GPU it computes on); refused, the rows "
          "are copied back to the host and sent, and it says why. Needs the "
          "CUDA runtime (libcudart.so.13) at run time.");
ABSL_FLAG(int, score_repeats, 1,
          "score: make the same call this many times on one client (its "
          "connections and regions kept between calls; the rows uploaded "
          "once with --cuda_shared_memory): a --timing line each, the rows "
          "printed once; fails when a call answers other bits than the "
          "first.");
ABSL_FLAG(int, connections, 0,
          "score: connections a call whose rows go in the messages is spread "
          "over; 0: 8 for calls of 8 MiB of rows or more, else 1.");
ABSL_FLAG(int64_t, spread_request_mb, 8,
          "score: MiB of rows per request of a spread call at most.");
ABSL_FLAG(int, spread_requests_in_flight, 2,
          "score: requests of a spread call outstanding per connection.");
ABSL_FLAG(int64_t, region_piece_mb, 4,
          "score, with --system_shared_memory: MiB of rows per piece, at "
          "least, of a call written into the client's region (at most 8 "
          "pieces, each written just before its request goes).");
ABSL_FLAG(int, cuda_device, 0,
          "score, with --cuda_shared_memory: the CUDA device the rows are "
          "uploaded to (numbered as the server numbers its GPUs).");
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
ABSL_FLAG(bool, project_malloc_tuning, false,
          "project: tune glibc's malloc for large streamed messages "
          "(docs/performance.md, projection streaming): re-execute with "
          "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge pages for "
          "the heap; skipped when GLIBC_TUNABLES already names that tunable), "
          "keep --project_heap_retain_mb of freed memory and use "
          "--project_malloc_arenas arenas. Off: malloc as the process found "
          "it. No other command changes malloc.");
ABSL_FLAG(int64_t, project_heap_retain_mb, 256,
          "project, with --project_malloc_tuning: MiB of freed memory malloc "
          "keeps at the top of each heap instead of returning it to the OS "
          "(0: glibc's default, 128 KiB); returned memory comes back as page "
          "faults on the next message.");
ABSL_FLAG(int, project_malloc_arenas, 1,
          "project, with --project_malloc_tuning: glibc malloc arenas (0: "
          "glibc's default, 8 per core). One keeps the stream readers' "
          "receive buffers in the main heap, reused.");
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
          "load: a checkpoint directory or .safetensors file relative to the "
          "server's --model_root.");
ABSL_FLAG(std::string, weights_file, "",
          "upload: a local Hugging Face checkpoint directory or .safetensors "
          "file holding the lm_head (F32/F16 are rounded to bf16, "
          "round-to-nearest-even, before sending; docs/checkpoints.md).");
ABSL_FLAG(std::string, lm_head_tensor, "",
          "load, upload: the [V, H] weight tensor's name; empty: "
          "lm_head.weight, else the tied input embedding (config.json).");
ABSL_FLAG(std::string, bias_tensor, "",
          "load, upload: the optional [V] bias tensor's name; empty: "
          "lm_head.bias when the head is lm_head.weight and it exists.");
ABSL_FLAG(int64_t, vocab_size, 0,
          "load, upload: the real vocabulary (0: every weight row).");
ABSL_FLAG(std::string, expected_sha256, "",
          "load: refuse unless the file's weights hash to this digest.");
ABSL_FLAG(int64_t, chunk_mb, 4, "upload: MiB per streamed chunk.");
ABSL_FLAG(std::string, servers, "",
          "upload: the servers to push to, comma-separated (default: "
          "--target); a dns:///name:port server (a headless Service) is "
          "every address the name resolves to.");
ABSL_FLAG(std::string, fanout, "",
          "upload to several --servers: chain (the first server forwards "
          "each chunk to the next as it arrives; those it does not reach get "
          "it directly) or direct (every server from here); empty: chain "
          "for more than two servers.");
ABSL_FLAG(bool, two_phase, true,
          "upload to several --servers: stage the version on every server, "
          "then make it the default on all of them at once, or abort it on "
          "all of them when any server failed to stage it (false: each "
          "server publishes as its upload ends).");
ABSL_FLAG(int64_t, base_version, 0,
          "upload: send only what changed against this version, which the "
          "servers hold (0: the whole head); needs --base_weights_file. A "
          "server without it gets the whole head.");
ABSL_FLAG(std::string, base_weights_file, "",
          "upload with --base_version: a local checkpoint directory or "
          ".safetensors file holding that version's lm_head (read as "
          "--weights_file is).");

namespace {

using detlogp::client::LogpClient;
using detlogp::client::ModelRepositoryClient;

constexpr char kUsage[] =
    "detlogp_cli <info|score|check-invariance|project|models|load|upload|"
    "unload> [--flags]";

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
  options.connections = absl::GetFlag(FLAGS_connections);
  // Bounded before it becomes bytes; LogpClient::Create refuses < 1.
  options.spread_request_bytes =
      std::clamp<int64_t>(absl::GetFlag(FLAGS_spread_request_mb), 0, 1 << 20)
      << 20;
  options.spread_requests_in_flight =
      absl::GetFlag(FLAGS_spread_requests_in_flight);
  options.region_piece_bytes =
      std::clamp<int64_t>(absl::GetFlag(FLAGS_region_piece_mb), 0, 1 << 20)
      << 20;
  if (!absl::GetFlag(FLAGS_tls_ca).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_tls_ca));
    options.tls_root_certs.assign(std::istreambuf_iterator<char>(in), {});
  }
  return options;
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

detlogp::client::ScoreCommandOptions ScoreOptions() {
  detlogp::client::ScoreCommandOptions options;
  options.model = absl::GetFlag(FLAGS_model);
  options.model_version = absl::GetFlag(FLAGS_model_version);
  options.hidden_path = absl::GetFlag(FLAGS_hidden);
  options.hidden_tensor = absl::GetFlag(FLAGS_hidden_tensor);
  options.target_ids_path = absl::GetFlag(FLAGS_targets);
  options.target_ids_tensor = absl::GetFlag(FLAGS_targets_tensor);
  options.random_rows = absl::GetFlag(FLAGS_random_rows);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.temperature = absl::GetFlag(FLAGS_temperature);
  options.return_lse = absl::GetFlag(FLAGS_return_lse);
  options.return_entropy = absl::GetFlag(FLAGS_entropy);
  options.top_k = absl::GetFlag(FLAGS_top_k);
  options.timing = absl::GetFlag(FLAGS_timing);
  options.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  options.cuda_shared_memory = absl::GetFlag(FLAGS_cuda_shared_memory);
  options.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  options.repeats = absl::GetFlag(FLAGS_score_repeats);
  return options;
}

detlogp::client::ProjectCommandOptions ProjectOptions() {
  detlogp::client::ProjectCommandOptions options;
  options.rows = absl::GetFlag(FLAGS_project_rows);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.rows_per_chunk = absl::GetFlag(FLAGS_rows_per_chunk);
  options.streams = absl::GetFlag(FLAGS_project_streams);
  options.repeats = absl::GetFlag(FLAGS_project_repeats);
  options.hash_y = absl::GetFlag(FLAGS_hash_y);
  options.hash_backlog_bytes =
      std::max<int64_t>(0, absl::GetFlag(FLAGS_hash_backlog_mb)) << 20;
  return options;
}

detlogp::client::ModelsCommandOptions ModelsOptions() {
  detlogp::client::ModelsCommandOptions options;
  options.model = absl::GetFlag(FLAGS_model);
  options.model_version = absl::GetFlag(FLAGS_model_version);
  options.path = absl::GetFlag(FLAGS_path);
  options.weights_file = absl::GetFlag(FLAGS_weights_file);
  options.lm_head_tensor = absl::GetFlag(FLAGS_lm_head_tensor);
  options.bias_tensor = absl::GetFlag(FLAGS_bias_tensor);
  options.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.expected_sha256 = absl::GetFlag(FLAGS_expected_sha256);
  options.servers =
      absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipWhitespace());
  options.fanout = absl::GetFlag(FLAGS_fanout);
  options.two_phase = absl::GetFlag(FLAGS_two_phase);
  options.base_version = absl::GetFlag(FLAGS_base_version);
  options.base_weights_file = absl::GetFlag(FLAGS_base_weights_file);
  return options;
}

detlogp::client::InvarianceOptions InvarianceCheckOptions() {
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
  return options;
}

// --project_malloc_tuning: process-wide, so set here, once, before any
// thread starts. glibc reads its tunables only when a process starts, hence
// the re-execution; it returns only when that is not needed or failed.
absl::Status TuneMallocForProjection(char** argv) {
  if (const std::optional<std::string> tunables =
          detlogp::client::TunablesWithMallocHugePages(
              std::getenv("GLIBC_TUNABLES"))) {
    setenv("GLIBC_TUNABLES", tunables->c_str(), 1);
    execv("/proc/self/exe", argv);
    std::cerr << "--project_malloc_tuning: could not re-execute ("
              << std::strerror(errno) << "); going on with 4 KiB pages\n";
  }
  if (absl::Status s = detlogp::client::RetainFreedHeapMemory(
          absl::GetFlag(FLAGS_project_heap_retain_mb) * (int64_t{1} << 20));
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--project_heap_retain_mb: ", s.message()));
  }
  if (absl::Status s = detlogp::client::LimitMallocArenas(
          absl::GetFlag(FLAGS_project_malloc_arenas));
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--project_malloc_arenas: ", s.message()));
  }
  return absl::OkStatus();
}

// The command's status; check-invariance also answers whether the bits held.
absl::StatusOr<bool> RunCommand(const std::string& command) {
  if (command == "check-invariance") {
    auto report = detlogp::client::CheckInvariance(InvarianceCheckOptions());
    if (!report.ok()) return report.status();
    std::cout << report->Summary() << "\n";
    return report->ok();
  }
  if (command == "info" || command == "score" || command == "project") {
    LogpClient::Options connection = ConnectionOptions();
    connection.system_shared_memory =
        command == "score" && absl::GetFlag(FLAGS_shared_memory);
    connection.cuda_shared_memory =
        command == "score" && absl::GetFlag(FLAGS_cuda_shared_memory);
    auto client = LogpClient::Create(connection);
    if (!client.ok()) return client.status();
    if (command == "score") {
      if (absl::Status s = RunScore(**client, ScoreOptions()); !s.ok()) {
        return s;
      }
    } else if (command == "project") {
      if (absl::Status s = RunProject(**client, ProjectOptions()); !s.ok()) {
        return s;
      }
    } else {
      auto info = (*client)->GetModelInfo(absl::GetFlag(FLAGS_model),
                                          absl::GetFlag(FLAGS_model_version));
      if (!info.ok()) return info.status();
      std::cout << info->DebugString();
    }
    return true;
  }
  if (command == "models" || command == "load" || command == "upload" ||
      command == "unload") {
    const detlogp::client::ModelsCommandOptions options = ModelsOptions();
    if (command != "models") {
      if (absl::Status s = RequireModel(options); !s.ok()) return s;
    }
    auto admin = AdminOptions();
    if (!admin.ok()) return admin.status();
    if (command == "upload") {
      if (!absl::GetFlag(FLAGS_targets).empty()) {
        return absl::InvalidArgumentError(
            "upload: --targets is score's file of target ids; the servers to "
            "push to are --servers");
      }
      if (absl::Status s = RunUpload(ConnectionOptions(), *admin, options);
          !s.ok()) {
        return s;
      }
      return true;
    }
    auto client = ModelRepositoryClient::Create(ConnectionOptions(), *admin);
    if (!client.ok()) return client.status();
    absl::Status status = command == "models" ? RunModels(**client)
                          : command == "load" ? RunLoad(**client, options)
                                              : RunUnload(**client, options);
    if (!status.ok()) return status;
    return true;
  }
  return absl::InternalError(absl::StrCat("no command ", command));
}

bool IsCommand(const std::string& name) {
  for (const char* command : {"info", "score", "check-invariance", "project",
                              "models", "load", "upload", "unload"}) {
    if (name == command) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
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
  if (args.size() != 2) {
    std::cerr << "usage: " << kUsage << "\n";
    return 2;
  }
  const std::string command = args[1];
  if (!IsCommand(command)) {
    std::cerr << "unknown command '" << command << "'; usage: " << kUsage
              << "\n";
    return 2;
  }
  if (command == "project" && absl::GetFlag(FLAGS_project_malloc_tuning)) {
    if (absl::Status s = TuneMallocForProjection(argv); !s.ok()) {
      std::cerr << "error: " << s << "\n";
      return 2;
    }
  }
  absl::StatusOr<bool> held = RunCommand(command);
  if (!held.ok()) {
    std::cerr << "error: " << held.status() << "\n";
    return 1;
  }
  // 3: the bits differed (check-invariance).
  return *held ? 0 : 3;
}
