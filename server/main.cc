// detlogp_server: flags in, Server::Options out, serve until SIGTERM/SIGINT.
#include <malloc.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "formats/checkpoint.h"
#include "server/models/lm_head_weights.h"
#include "server/server.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on.");
ABSL_FLAG(int, port, 50051, "Port to listen on; 0 picks a free one.");
ABSL_FLAG(
    std::string, unix_socket, "",
    "Also listen on this Unix-domain socket path (clients on the same host: "
    "target unix:PATH; faster than loopback TCP for large streams). "
    "Plaintext even with --tls_cert (bearer tokens still apply); access "
    "follows the socket file's mode (the umask). A stale socket is replaced; "
    "a live one or another file is refused.");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound port is written here once serving (for tests).");
ABSL_FLAG(std::string, weights, "",
          "The model \"default\": a Hugging Face checkpoint directory "
          "(model.safetensors or shards with model.safetensors.index.json, "
          "and config.json) or one .safetensors file holding the lm_head "
          "(docs/checkpoints.md); with neither --weights nor --model, the "
          "embedded synthetic model is served as \"default\".");
ABSL_FLAG(std::vector<std::string>, model, {},
          "Named start-up models, name=path[:tensor], path a checkpoint "
          "directory or a .safetensors file; repeat the flag or separate "
          "with commas (--model=policy=/m/qwen --model=tied=/m/small:"
          "model.embed_tokens.weight). :tensor names that model's head "
          "(default: lm_head.weight, else the tied input embedding); "
          "--bias_tensor and --vocab_size apply to each.");
ABSL_FLAG(std::string, default_model, "",
          "The model an empty request.model means; empty: \"default\" when "
          "--weights is given or nothing is, else the first --model.");
ABSL_FLAG(std::string, model_root, "",
          "Directory LoadModel may read (paths relative to it) and where "
          "uploaded versions are kept (<root>/<model>/<version>/) so a "
          "restart serves them again; empty: no LoadModel, uploads in memory "
          "only.");
ABSL_FLAG(int, max_versions_per_model, 2,
          "Ready versions kept per model; a new one unloads the oldest once "
          "its requests are answered.");
ABSL_FLAG(int64_t, max_model_memory_bytes, 0,
          "Bound on the bytes all model versions hold (device bytes summed "
          "over GPUs on CUDA, host bytes on the CPU); uploads beyond it get "
          "RESOURCE_EXHAUSTED before any byte is taken. 0: no bound.");
ABSL_FLAG(int, staged_version_timeout_s, 60,
          "A staged version (an upload with header.stage, the first phase of "
          "a fleet's two-phase publish) not committed within this many "
          "seconds is dropped.");
ABSL_FLAG(std::vector<std::string>, pull_from, {},
          "Comma-separated peers (host:port) to copy the newest model "
          "versions from at start-up, before health reports SERVING (a "
          "replica that starts or restarts joins the fleet at its version). "
          "The list may name this server. Unreachable peers are skipped.");
ABSL_FLAG(std::string, peer_tls_ca, "",
          "With --tls_cert: PEM roots that peers' certificates (--pull_from, "
          "the next server of a chain push) are checked against; empty: "
          "--tls_cert itself (one certificate every replica shares, naming "
          "every peer's host).");
ABSL_FLAG(int, pull_timeout_s, 600, "Bound on the --pull_from download.");
ABSL_FLAG(std::string, admin_tokens_file, "",
          "File of bearer tokens for ModelRepositoryService (load, upload, "
          "unload, list). Without it, admin calls are accepted only when "
          "--host is loopback.");
ABSL_FLAG(int64_t, synthetic_hidden_size, 1024,
          "H of the embedded synthetic model (no --weights).");
ABSL_FLAG(int64_t, synthetic_vocab_size, 32000,
          "V of the embedded synthetic model (no --weights).");
ABSL_FLAG(std::string, lm_head_tensor, "",
          "The [V, H] head tensor of --weights (each --model names its own "
          "as name=path:tensor); empty: lm_head.weight, else the input "
          "embedding when config.json says tie_word_embeddings. Without "
          "--weights (deprecated): the head of each --model that names none, "
          "never in place of a checkpoint's own lm_head.weight.");
ABSL_FLAG(std::string, bias_tensor, "",
          "The optional [V] bias tensor; empty: lm_head.bias when the head "
          "is lm_head.weight and the checkpoint has one.");
ABSL_FLAG(int64_t, vocab_size, 0,
          "Rows of the head that count (<= its rows); 0: every row, which is "
          "what Hugging Face and vLLM normalise over. Only for heads padded "
          "beyond the tokenizer on purpose: rows past it are left out of "
          "the softmax, so log-probs then differ from Hugging Face's and "
          "vLLM's by however much probability those rows held.");
ABSL_FLAG(
    std::string, device, "auto",
    "auto (first GPU of compute capability >= 8.0, else CPU), cpu, cuda:N, "
    "or cuda:all (every GPU of the first one's kind, batches to the "
    "least-loaded).");
ABSL_FLAG(std::string, logp_kernel, "auto",
          "CUDA linear-logp kernel: auto (hopper on compute capability 9.0, "
          "portable on other GPUs >= 8.0), hopper (9.0 only; fails at start "
          "elsewhere) or portable (mma.sync, any GPU >= 8.0).");
ABSL_FLAG(bool, vocab_parallel, false,
          "With --device=cuda:all: each GPU holds a contiguous share of the "
          "vocabulary splits instead of the whole lm_head (bits unchanged).");
ABSL_FLAG(int64_t, max_batch_rows, -1,
          "Rows per batch at most; -1: the backend's (CUDA 4096, CPU 256).");
ABSL_FLAG(int64_t, max_queue_delay_us, -1,
          "Longest a queued row waits for a fuller batch, microseconds; -1: "
          "the backend's (CUDA 0, CPU 500).");
ABSL_FLAG(int64_t, max_queue_rows, 1 << 20,
          "Rows waiting at most; beyond it calls get RESOURCE_EXHAUSTED "
          "(reason QUEUE_FULL, with a retry delay).");
ABSL_FLAG(
    int64_t, max_queue_work_ms, 1000,
    "The queue's bound in time: rows waiting at most, as milliseconds of "
    "work at the rate full batches drain them (measured; never below two "
    "full batches per batch thread; a request into an empty queue is always "
    "taken). 0: --max_queue_rows only.");
ABSL_FLAG(int64_t, max_queue_bytes, int64_t{2} << 30,
          "bf16 bytes of waiting rows held in the server's memory (rows that "
          "came in messages; rows in shared memory are not counted).");
ABSL_FLAG(int64_t, max_request_rows, 65536,
          "Rows one request may carry; larger ones get INVALID_ARGUMENT.");
ABSL_FLAG(int64_t, max_top_k, 20,
          "Largest top_k a request may ask for (0 .. 32); larger ones get "
          "INVALID_ARGUMENT.");
ABSL_FLAG(int, max_message_mb, 640,
          "Largest gRPC message, MiB, 1..2047 (the default fits a request of "
          "65,536 x 4,096 bf16 rows; GetModelInfo reports it, and the "
          "clients cut larger calls to fit).");
ABSL_FLAG(int, keep_freed_memory_mb, 1024,
          "MiB of freed heap memory malloc keeps for reuse, 0..2047 (0: "
          "glibc's defaults, which unmap each large request's buffers, so "
          "the next one is received into fresh pages).");
ABSL_FLAG(std::optional<bool>, allow_shared_memory, std::nullopt,
          "true or false: SharedMemoryService and requests naming "
          "shared-memory regions, for callers on this host only (the Unix "
          "socket, loopback). Not given: on if --host is loopback, off "
          "otherwise.");
ABSL_FLAG(int64_t, max_shared_memory_bytes, int64_t{64} << 30,
          "Bytes all registered shared-memory regions may span together; "
          "registrations beyond it get RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, shared_memory_idle_s, 300,
          "A shared-memory region no request named for this many seconds is "
          "released (a client killed without unregistering leaks nothing for "
          "long); 0: never.");
ABSL_FLAG(std::string, projection_weights, "",
          "A .safetensors file with the H3 video input projection; empty "
          "serves seeded synthetic weights.");
ABSL_FLAG(std::string, projection_weight_tensor, "proj.weight",
          "Name of the [5376, 96] F32 weight in --projection_weights.");
ABSL_FLAG(std::string, projection_bias_tensor, "proj.bias",
          "Name of the optional [5376] F32 bias in --projection_weights.");
ABSL_FLAG(int64_t, projection_max_launch_rows, 2048,
          "Projection rows per launch (also the largest rows_per_chunk).");
ABSL_FLAG(int, projection_threads, 0,
          "Projection launches in flight at once (each with its own staging "
          "and GPU stream); 0: the backend's preference.");
ABSL_FLAG(int64_t, projection_stream_buffer_mb, 64,
          "Output MiB one projection stream may hold in chunk buffers "
          "(computed, waiting or being written; two chunks at least).");
ABSL_FLAG(int64_t, projection_chunk_cache_mb, 1024,
          "MiB of idle chunk-buffer memory kept for reuse when the backend "
          "allocates its own (CUDA: pinned, in 128 MiB blocks that buffers of "
          "any size are carved from; costly to pin again); beyond it the "
          "blocks with nothing in use are freed, idle longest first.");
ABSL_FLAG(int, batch_threads, 0,
          "Batches in flight at once; 0: the backend's preference.");
ABSL_FLAG(int64_t, batch_overlap_rows, -1,
          "While a batch runs, another starts only once this many rows wait "
          "(-1: max_batch_rows / 4); keeps small calls from queueing on the "
          "device under light load.");
ABSL_FLAG(int64_t, batch_spin_us, -1,
          "An idle batch thread polls for work this long before sleeping "
          "(one thread at a time; -1: the backend's preference, 1000 on a "
          "GPU, 0 on the CPU).");
ABSL_FLAG(int, cpu_threads, 0, "CPU backend threads; 0: all cores.");
ABSL_FLAG(int, metrics_port, -1,
          "Prometheus /metrics port on --host: -1 off, 0 a free port (written "
          "as the second line of --port_file).");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain; enables TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; clients must present a certificate it signed.");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "File of accepted bearer tokens, one per line ('#' comments). Calls "
          "without one get UNAUTHENTICATED; health stays open.");
ABSL_FLAG(int, max_concurrent_streams, 256,
          "HTTP/2 streams one connection may have open at once.");
ABSL_FLAG(int, shutdown_grace_s, 30,
          "Seconds SIGTERM waits for accepted calls before cancelling them.");

namespace {

using detlogp::server::LmHeadWeights;

detlogp::server::LmHeadSource SourceFromFlags(const std::string& path,
                                              const std::string& tensor) {
  detlogp::server::LmHeadSource source;
  source.path = path;
  source.weight_tensor = tensor;
  source.bias_tensor = absl::GetFlag(FLAGS_bias_tensor);
  source.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  return source;
}

// A --model value: name=path, or name=path:tensor (tensor names hold no '/',
// so a ':' followed by a '/' belongs to the path). `shared_tensor` is
// --lm_head_tensor given without --weights (the older form, for every
// --model that names no tensor): it never replaces a checkpoint's own
// lm_head.weight, so a tied and an untied checkpoint cannot end up serving
// the same kind of tensor by accident.
absl::StatusOr<detlogp::server::StartupModel> ParseModelSpec(
    const std::string& spec, const std::string& shared_tensor) {
  const size_t eq = spec.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model=", spec,
        ": expected name=path or name=path:tensor (path a checkpoint "
        "directory or a .safetensors file)"));
  }
  const std::string name = spec.substr(0, eq);
  std::string path = spec.substr(eq + 1);
  std::string tensor;
  const size_t colon = path.rfind(':');
  if (colon != std::string::npos &&
      path.find('/', colon) == std::string::npos) {
    tensor = path.substr(colon + 1);
    path = path.substr(0, colon);
    if (tensor.empty() || path.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--model=", spec, ": expected name=path:tensor with both given"));
    }
  }
  const std::string source =
      tensor.empty() ? path : absl::StrCat(path, ":", tensor);
  auto load = [name, path, shared_tensor,
               lm_head = SourceFromFlags(
                   path, tensor)]() mutable -> absl::StatusOr<LmHeadWeights> {
    if (lm_head.weight_tensor.empty() && !shared_tensor.empty() &&
        shared_tensor != "lm_head.weight") {
      detlogp::formats::HeadLookup lookup;
      lookup.path = path;
      lookup.bias_tensor = lm_head.bias_tensor;
      auto own = detlogp::formats::ResolveHead(lookup);
      if (own.ok() && own->weight_tensor == "lm_head.weight") {
        return absl::InvalidArgumentError(absl::StrCat(
            path,
            " has its own lm_head.weight; --lm_head_tensor=", shared_tensor,
            " (given for every --model) is not used in its place: name it "
            "for this model to serve it (--model=",
            name, "=", path, ":", shared_tensor, ")"));
      }
      lm_head.weight_tensor = shared_tensor;
    }
    return detlogp::server::LoadLmHead(lm_head);
  };
  return detlogp::server::StartupModel{name, source, std::move(load)};
}

// --weights, every --model, or the embedded synthetic model. Each is loaded
// by the server, and only when --model_root does not hold a newer version.
absl::StatusOr<std::vector<detlogp::server::StartupModel>> StartupModels() {
  std::vector<detlogp::server::StartupModel> models;
  const std::string weights = absl::GetFlag(FLAGS_weights);
  const std::string lm_head_tensor = absl::GetFlag(FLAGS_lm_head_tensor);
  if (!weights.empty()) {
    models.push_back({"default", weights,
                      [source = SourceFromFlags(weights, lm_head_tensor)] {
                        return detlogp::server::LoadLmHead(source);
                      }});
  } else if (!lm_head_tensor.empty()) {
    spdlog::warn(
        "--lm_head_tensor={} without --weights applies to each --model that "
        "names no tensor, and never in place of a checkpoint's own "
        "lm_head.weight; name each model's head instead "
        "(--model=name=path:tensor)",
        lm_head_tensor);
  }
  const std::string shared_tensor = weights.empty() ? lm_head_tensor : "";
  for (const std::string& spec : absl::GetFlag(FLAGS_model)) {
    auto model = ParseModelSpec(spec, shared_tensor);
    if (!model.ok()) return model.status();
    models.push_back(*std::move(model));
  }
  if (models.empty()) {
    detlogp::server::SyntheticLmHeadOptions synthetic;
    synthetic.hidden_size = absl::GetFlag(FLAGS_synthetic_hidden_size);
    synthetic.vocab_size = absl::GetFlag(FLAGS_synthetic_vocab_size);
    if (synthetic.hidden_size <= 0 || synthetic.vocab_size <= 0) {
      return absl::InvalidArgumentError("synthetic model sizes must be > 0");
    }
    spdlog::info(
        "no --weights or --model given: serving the EMBEDDED SYNTHETIC "
        "model (fixed seed) as \"default\", not a real lm_head");
    models.push_back({"default", "synthetic",
                      [synthetic]() -> absl::StatusOr<LmHeadWeights> {
                        return detlogp::server::SyntheticLmHead(synthetic);
                      }});
  }
  return models;
}

// Abseil keeps the last of repeated flags; --model is a list, so every
// occurrence is folded into one comma-separated value first.
std::vector<char*> FoldRepeatedModelFlags(int argc, char** argv,
                                          std::string* folded) {
  std::vector<char*> args;
  std::vector<std::string> specs;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--model=", 0) == 0) {
      specs.push_back(arg.substr(8));
    } else if (arg == "--model" && i + 1 < argc) {
      specs.push_back(argv[++i]);
    } else {
      args.push_back(argv[i]);
    }
  }
  if (!specs.empty()) {
    *folded = absl::StrCat("--model=", absl::StrJoin(specs, ","));
    args.push_back(folded->data());
  }
  return args;
}

absl::StatusOr<detlogp::server::ProjectionWeights> LoadProjection() {
  const std::string path = absl::GetFlag(FLAGS_projection_weights);
  if (path.empty()) {
    spdlog::info(
        "no --projection_weights given: the H3 projection serves "
        "seeded SYNTHETIC weights");
    return detlogp::server::SyntheticProjectionWeights();
  }
  detlogp::server::ProjectionSource source;
  source.path = path;
  source.weight_tensor = absl::GetFlag(FLAGS_projection_weight_tensor);
  source.bias_tensor = absl::GetFlag(FLAGS_projection_bias_tensor);
  return detlogp::server::LoadProjectionWeights(source);
}

// A MiB-valued flag as bytes: INVALID_ARGUMENT naming the flag outside
// [min_mib, max_mib] (a shift of a huge or negative value would overflow
// or be undefined).
absl::StatusOr<int64_t> FlagMebibytes(absl::string_view flag, int64_t mib,
                                      int64_t min_mib, int64_t max_mib) {
  if (mib < min_mib || mib > max_mib) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", mib,
                                                   " is outside [", min_mib,
                                                   ", ", max_mib, "] MiB"));
  }
  return mib * (int64_t{1} << 20);
}

// A large request is received into buffers of its size; with glibc's
// defaults they are mapped for it and unmapped when it is answered, so the
// next request's bytes land on fresh pages (a fault and a zeroed page for
// every 4 KiB). Keeping freed memory in the heap lets the next request reuse
// it: one connection's 32 MiB requests went from 0.52 to 0.64 GB/s on the
// H200 host (docs/performance.md, "One caller's large batch"). Process-wide,
// so main sets it before any thread starts.
absl::Status KeepFreedMemory(int mib) {
  if (mib < 0 || mib > 2047) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--keep_freed_memory_mb=", mib, " is outside [0, 2047] MiB"));
  }
  if (mib == 0) return absl::OkStatus();
  const int bytes = mib << 20;
  // Below M_MMAP_THRESHOLD an allocation comes from the heap, whose freed
  // top is returned to the OS only beyond M_TRIM_THRESHOLD.
  if (mallopt(M_MMAP_THRESHOLD, std::min(bytes, 256 << 20)) != 1 ||
      mallopt(M_TRIM_THRESHOLD, bytes) != 1) {
    return absl::InternalError("malloc refused --keep_freed_memory_mb");
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves deterministic, batch-invariant log-probabilities over gRPC.");
  // Abseil's --help and --helpshort list only flags defined in a file named
  // after the program (detlogp_server.cc); ours live here, in main.cc.
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return file == __FILE__;
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  usage_config.contains_helppackage_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  std::string folded_models;
  std::vector<char*> args = FoldRepeatedModelFlags(argc, argv, &folded_models);
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    // A shell glob (--weights=/m/ckpt/*.safetensors) leaves every file but
    // the first here; serving the first alone would be a silent guess.
    std::vector<std::string> extra(positional.begin() + 1, positional.end());
    spdlog::error(
        "unexpected arguments: {}; several files given? --weights and "
        "--model take one path each: a checkpoint directory (its shards are "
        "found through model.safetensors.index.json) or one .safetensors "
        "file",
        absl::StrJoin(extra, " "));
    return 2;
  }

  if (absl::Status kept =
          KeepFreedMemory(absl::GetFlag(FLAGS_keep_freed_memory_mb));
      !kept.ok()) {
    spdlog::error("{}", kept.ToString());
    return 2;
  }

  // Signals are taken synchronously by this thread (sigwait below); every
  // thread started later inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto models = StartupModels();
  if (!models.ok()) {
    spdlog::error("{}", models.status().ToString());
    return 2;
  }

  auto projection = LoadProjection();
  if (!projection.ok()) {
    spdlog::error("cannot load projection weights: {}",
                  projection.status().ToString());
    return 2;
  }

  detlogp::server::Server::Options options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.unix_socket_path = absl::GetFlag(FLAGS_unix_socket);
  options.device = absl::GetFlag(FLAGS_device);
  options.vocab_parallel = absl::GetFlag(FLAGS_vocab_parallel);
  options.logp_kernel = absl::GetFlag(FLAGS_logp_kernel);
  // gRPC's message limits are ints: at most 2047 MiB.
  auto max_message_bytes = FlagMebibytes(
      "max_message_mb", absl::GetFlag(FLAGS_max_message_mb), 1, 2047);
  auto stream_buffer_bytes = FlagMebibytes(
      "projection_stream_buffer_mb",
      absl::GetFlag(FLAGS_projection_stream_buffer_mb), 1, int64_t{1} << 30);
  auto chunk_cache_bytes = FlagMebibytes(
      "projection_chunk_cache_mb",
      absl::GetFlag(FLAGS_projection_chunk_cache_mb), 0, int64_t{1} << 30);
  for (const auto* bytes :
       {&max_message_bytes, &stream_buffer_bytes, &chunk_cache_bytes}) {
    if (!bytes->ok()) {
      spdlog::error("{}", bytes->status().ToString());
      return 2;
    }
  }
  options.max_message_bytes = static_cast<int>(*max_message_bytes);
  options.max_request_rows = absl::GetFlag(FLAGS_max_request_rows);
  options.max_top_k = absl::GetFlag(FLAGS_max_top_k);
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.batcher.max_batch_rows = absl::GetFlag(FLAGS_max_batch_rows);
  options.batcher.max_queue_delay_micros =
      absl::GetFlag(FLAGS_max_queue_delay_us);
  options.batcher.max_queue_rows = absl::GetFlag(FLAGS_max_queue_rows);
  options.batcher.max_queue_work_micros =
      absl::GetFlag(FLAGS_max_queue_work_ms) * 1000;
  options.batcher.max_queue_bytes = absl::GetFlag(FLAGS_max_queue_bytes);
  options.batcher.num_batch_threads = absl::GetFlag(FLAGS_batch_threads);
  options.batcher.min_rows_to_overlap = absl::GetFlag(FLAGS_batch_overlap_rows);
  options.batcher.idle_spin_micros = absl::GetFlag(FLAGS_batch_spin_us);
  options.shutdown_grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s));
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.tls_cert_path = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_path = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_path = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_tokens_path = absl::GetFlag(FLAGS_auth_tokens_file);
  options.admin_tokens_path = absl::GetFlag(FLAGS_admin_tokens_file);
  options.default_model = absl::GetFlag(FLAGS_default_model);
  options.model_root = absl::GetFlag(FLAGS_model_root);
  options.max_versions_per_model = absl::GetFlag(FLAGS_max_versions_per_model);
  options.max_model_memory_bytes = absl::GetFlag(FLAGS_max_model_memory_bytes);
  options.staged_version_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_staged_version_timeout_s));
  options.pull_from = absl::GetFlag(FLAGS_pull_from);
  options.peer_tls_ca_path = absl::GetFlag(FLAGS_peer_tls_ca);
  options.pull_timeout = absl::Seconds(absl::GetFlag(FLAGS_pull_timeout_s));
  options.max_concurrent_streams_per_connection =
      absl::GetFlag(FLAGS_max_concurrent_streams);
  // Unset, the server decides from its listeners (Server::Options).
  options.allow_shared_memory = absl::GetFlag(FLAGS_allow_shared_memory);
  options.max_shared_memory_bytes =
      absl::GetFlag(FLAGS_max_shared_memory_bytes);
  const int64_t idle_s = absl::GetFlag(FLAGS_shared_memory_idle_s);
  if (idle_s < 0) {
    spdlog::error("--shared_memory_idle_s={} is negative", idle_s);
    return 2;
  }
  options.shared_memory_idle = absl::Seconds(idle_s);
  options.projection_max_launch_rows =
      absl::GetFlag(FLAGS_projection_max_launch_rows);
  options.projection_threads = absl::GetFlag(FLAGS_projection_threads);
  options.projection_stream_buffer_bytes = *stream_buffer_bytes;
  options.projection_chunk_cache_bytes = *chunk_cache_bytes;

  auto server = detlogp::server::Server::BuildAndStart(
      options, *std::move(models), *std::move(projection));
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    std::ofstream(port_file + ".tmp") << (*server)->port() << "\n"
                                      << (*server)->metrics_port() << "\n";
    std::rename((port_file + ".tmp").c_str(), port_file.c_str());
  }

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  spdlog::info("signal {}: draining accepted calls, then exiting",
               signal_number);
  (*server)->Shutdown();
  spdlog::info("bye");
  return 0;
}
