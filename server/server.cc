#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <cmath>
#include <functional>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "kernels/lm_head.h"
#include "kernels/split_policy.h"
#include "digests/determinism_key.h"
#include "server/transport/local_peer.h"
#include "server/transport/peer_pull.h"
#include "server/transport/unix_socket.h"
#include "spdlog/spdlog.h"

namespace detlogp::server {
namespace {

constexpr char kLogProbServiceName[] = "detlogp.v1.LogProbService";
constexpr char kProjectionServiceName[] = "detlogp.v1.ProjectionService";

constexpr char kRepositoryServiceName[] = "detlogp.v1.ModelRepositoryService";

// Runs a few rows of a new version end to end through the batcher, so that
// its first real call pays no start-up cost and a broken placement is found
// before the version serves.
// The first token of a tokens file (one per line; blank lines and '#'
// comments skipped), which this server presents to its peers.
absl::StatusOr<std::string> FirstTokenIn(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read ", path));
  }
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view token = absl::StripAsciiWhitespace(line);
    if (!token.empty() && token[0] != '#') return std::string(token);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path, " holds no token (needed for --pull_from)"));
}

absl::Status WarmUp(DynamicBatcher* batcher, const ServedVersion& version) {
  const int64_t rows = 2;
  std::vector<uint16_t> hidden(rows * version.hidden_size, 0x3f80);  // 1.0
  std::vector<int32_t> targets = {0,
                                  static_cast<int32_t>(version.vocab_size - 1)};
  absl::Notification done;
  absl::Status result;
  auto job = std::make_shared<LogpJob>(
      version.placed, rows, std::move(hidden), std::move(targets), 1.0f,
      absl::InfiniteFuture(), [&](absl::Status status, LogpJob& job) {
        result = status;
        for (int64_t r = 0; result.ok() && r < rows; ++r) {
          if (!std::isfinite(job.logprobs()[r]) ||
              !std::isfinite(job.lse()[r])) {
            result = absl::InternalError(
                absl::StrCat("warm-up row ", r, " gave logprob ",
                             job.logprobs()[r], ", lse ", job.lse()[r]));
          }
        }
        done.Notify();
      });
  // Two rows over the queue bound: a full queue of scoring traffic must not
  // refuse a version that arrived whole.
  if (absl::Status s = batcher->ScheduleInternal(job); !s.ok()) return s;
  done.WaitForNotification();
  return result;
}

bool IsLoopbackHost(const std::string& host) {
  return host == "127.0.0.1" || host == "::1" || host == "localhost";
}

// The projection's key names its arithmetic, not its backend: CPU and CUDA
// compute the same fixed fma chain and give identical bits (tested on the
// GPU), so they share a key.
std::string ProjectionDeterminismKey(const ProjectionWeights& weights) {
  return digests::DeterminismKey(
      {weights.sha256, "h3-projection", "ieee-fp32-fma",
       "fma-chain-k-ascending-then-bias/v1", "rows-independent"});
}

// Counts every finished call by method and gRPC code.
std::function<void(absl::string_view, int)> CountCallsInto(
    ServerMetrics* metrics) {
  return [metrics](absl::string_view method, int code) {
    metrics->CountRequest(method, code);
  };
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const Server::Options& options) {
  if (options.tls_cert_path.empty() != options.tls_key_path.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (options.tls_cert_path.empty()) {
    if (!options.tls_client_ca_path.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  auto cert = ReadPem(options.tls_cert_path, "--tls_cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(options.tls_key_path, "--tls_key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.tls_client_ca_path.empty()) {
    auto ca = ReadPem(options.tls_client_ca_path, "--tls_client_ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// "[::1]" for an IPv6 host, so that a port can follow it.
std::string BracketedHost(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::BuildAndStart(
    const Options& options, std::vector<StartupModel> models,
    ProjectionWeights projection_weights) {
  if (absl::Status s = ValidateOptions(options, models); !s.ok()) return s;
  // TLS files are read before anything is built, so that a bad path fails
  // fast.
  auto credentials = MakeCredentials(options);
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<Server> server(new Server());
  server->options_ = options;
  server->metrics_ = std::make_unique<ServerMetrics>();
  // Each step builds on the ones before it. On an error the unique_ptr's
  // destructor shuts down whatever was started.
  if (absl::Status s = server->LoadAuthenticators(); !s.ok()) return s;
  if (absl::Status s = server->MakePeerCredentials(); !s.ok()) return s;
  if (absl::Status s = server->CreateBackend(); !s.ok()) return s;
  if (absl::Status s = server->CreateBatcher(); !s.ok()) return s;
  if (absl::Status s = server->OpenModelStore(); !s.ok()) return s;
  const std::string default_model = options.default_model.empty()
                                        ? models.front().name
                                        : options.default_model;
  if (absl::Status s = server->CreateModelManager(default_model); !s.ok()) {
    return s;
  }
  if (absl::Status s = server->LoadModels(std::move(models)); !s.ok()) return s;
  if (absl::Status s = server->StartSharedMemory(); !s.ok()) return s;
  server->BuildLogProbService();
  server->BuildRepositoryService();
  if (absl::Status s = server->StartProjection(std::move(projection_weights));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = server->StartListeners(*credentials); !s.ok()) return s;
  if (absl::Status s = server->StartMetricsEndpoint(); !s.ok()) return s;
  if (absl::Status s = server->PullFromPeers(); !s.ok()) return s;
  server->ReportServing();
  return server;
}

absl::Status Server::ValidateOptions(const Options& options,
                                     const std::vector<StartupModel>& models) {
  if (models.empty()) return absl::InvalidArgumentError("no model to serve");
  if (options.pull_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--pull_timeout_s must be > 0");
  }
  if (options.max_top_k < 0 || options.max_top_k > kernels::kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_top_k=", options.max_top_k, " is outside [0, ",
                     kernels::kMaxTopK, "]"));
  }
  if (options.projection_stream_buffer_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--projection_stream_buffer_mb must be positive, got ",
                     options.projection_stream_buffer_bytes >> 20));
  }
  if (options.projection_chunk_cache_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--projection_chunk_cache_mb must be >= 0, got ",
                     options.projection_chunk_cache_bytes >> 20));
  }
  if (options.projection_threads < 0 || options.projection_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--projection_threads=", options.projection_threads,
                     " is outside [0, 64]"));
  }
  return absl::OkStatus();
}

absl::Status Server::LoadAuthenticators() {
  for (auto [path, authenticator] :
       {std::pair{&options_.auth_tokens_path, &authenticator_},
        {&options_.admin_tokens_path, &admin_authenticator_}}) {
    if (path->empty()) continue;
    auto loaded = TokenAuthenticator::FromFile(*path);
    if (!loaded.ok()) return loaded.status();
    *authenticator = *std::move(loaded);
  }
  return absl::OkStatus();
}

absl::Status Server::CreateBackend() {
  LogpBackendRegistry registry;
  RegisterBuiltinBackends(&registry);
  BackendOptions backend_options;
  backend_options.cpu_threads = options_.cpu_threads;
  backend_options.vocab_parallel = options_.vocab_parallel;
  backend_options.logp_kernel = options_.logp_kernel;
  std::vector<std::string> notes;
  auto backend = registry.Create(options_.device, backend_options, &notes);
  for (const std::string& note : notes) spdlog::info("{}", note);
  if (!backend.ok()) return backend.status();
  backend_ = *std::move(backend);
  const BackendDescription& description = backend_->description();
  spdlog::info("backend {} on {} (kernel {}, isa {})", description.name,
               description.device, description.kernel_version,
               description.instruction_set);
  if (!description.extras_unavailable.empty()) {
    spdlog::warn("return_entropy and top_k are refused: {}",
                 description.extras_unavailable);
  }
  return absl::OkStatus();
}

absl::Status Server::CreateBatcher() {
  const BackendDescription& description = backend_->description();
  DynamicBatcher::Options batcher_options = options_.batcher;
  if (batcher_options.max_batch_rows < 0) {
    batcher_options.max_batch_rows = description.preferred_max_batch_rows;
  }
  if (batcher_options.max_queue_delay_micros < 0) {
    batcher_options.max_queue_delay_micros =
        description.preferred_max_queue_delay_micros;
  }
  if (batcher_options.num_batch_threads <= 0) {
    batcher_options.num_batch_threads = description.preferred_inflight_batches;
  }
  if (batcher_options.idle_spin_micros < 0) {
    batcher_options.idle_spin_micros = description.preferred_idle_spin_micros;
  }
  ServerMetrics* metrics = metrics_.get();
  batcher_options.on_batch = [metrics](const DynamicBatcher::BatchRecord& r) {
    metrics->ObserveBatch(
        r.rows, r.requests, absl::ToDoubleSeconds(r.queue_delay),
        absl::ToDoubleSeconds(r.gather), absl::ToDoubleSeconds(r.compute));
  };
  auto batcher = DynamicBatcher::Create(batcher_options, backend_.get());
  if (!batcher.ok()) return batcher.status();
  spdlog::info(
      "batching: max_batch_rows={} max_queue_delay_us={} batch_threads={} "
      "batch_spin_us={} (flags or the {} backend's defaults); queue bound "
      "max_queue_rows={} max_queue_work_ms={} max_queue_bytes={}",
      batcher_options.max_batch_rows, batcher_options.max_queue_delay_micros,
      batcher_options.num_batch_threads, batcher_options.idle_spin_micros,
      description.name, batcher_options.max_queue_rows,
      batcher_options.max_queue_work_micros / 1000,
      batcher_options.max_queue_bytes);
  batcher_ = *std::move(batcher);
  return absl::OkStatus();
}

absl::Status Server::OpenModelStore() {
  if (options_.model_root.empty()) return absl::OkStatus();
  auto store = ModelStore::Open(options_.model_root);
  if (!store.ok()) return store.status();
  model_store_ = *std::move(store);
  if (!model_store_->writable()) {
    spdlog::warn(
        "--model_root={} is read-only: LoadModel works, uploads serve "
        "but are not kept for a restart",
        options_.model_root);
  }
  return absl::OkStatus();
}

absl::Status Server::CreateModelManager(const std::string& default_model) {
  const BackendDescription& description = backend_->description();
  // The batcher's options as resolved against the backend's preferences.
  const DynamicBatcher::Options& batching = batcher_->options();
  ModelManager::Options manager_options;
  manager_options.default_model = default_model;
  manager_options.max_versions_per_model = options_.max_versions_per_model;
  manager_options.max_model_memory_bytes = options_.max_model_memory_bytes;
  manager_options.staged_timeout = options_.staged_version_timeout;
  manager_options.store = model_store_.get();
  manager_options.key_inputs.backend = description.name;
  manager_options.key_inputs.instruction_set = description.instruction_set;
  manager_options.key_inputs.kernel_version = description.kernel_version;
  manager_options.key_inputs.split_policy = kernels::kSplitPolicyName;
  // ModelInfo.backend: where and on what code the bits are computed (the
  // kernel version has its own field), and what this server cannot compute.
  manager_options.backend_description =
      absl::StrCat(description.name, " (", description.device, "; isa ",
                   description.instruction_set, ")",
                   description.extras_unavailable.empty()
                       ? ""
                       : absl::StrCat("; no entropy or top_k: ",
                                      description.extras_unavailable));
  manager_options.batching.set_max_batch_rows(batching.max_batch_rows);
  manager_options.batching.set_max_queue_delay_us(
      batching.max_queue_delay_micros);
  manager_options.batching.set_batch_threads(batching.num_batch_threads);
  manager_options.batching.set_batch_spin_us(batching.idle_spin_micros);
  LogpBackend* backend = backend_.get();
  DynamicBatcher* batcher = batcher_.get();
  manager_options.place = [backend](std::shared_ptr<const LmHeadWeights> w) {
    return backend->Load(std::move(w));
  };
  manager_options.estimate_bytes = [backend](int64_t h, int64_t v, bool bias) {
    return backend->EstimateBytes(h, v, bias);
  };
  manager_options.warm_up = [batcher](const ServedVersion& version) {
    return WarmUp(batcher, version);
  };
  auto manager = ModelManager::Create(std::move(manager_options));
  if (!manager.ok()) return manager.status();
  models_ = *std::move(manager);
  return absl::OkStatus();
}

absl::Status Server::LoadModels(std::vector<StartupModel> models) {
  std::map<std::string, std::vector<StoredVersion>> stored;
  if (model_store_ != nullptr) stored = model_store_->ListVersions();
  // The latest max_versions_per_model complete stored versions of every
  // model whose files still hash to their manifests, published oldest first
  // (so pinned re-scoring survives a restart). Older ones leave the store;
  // damaged ones stay for the operator to look at, and new versions are
  // numbered above every directory on disk.
  for (auto& [name, versions] : stored) {
    std::vector<std::pair<const StoredVersion*, LmHeadWeights>> restored;
    for (auto it = versions.rbegin(); it != versions.rend(); ++it) {
      if (static_cast<int>(restored.size()) ==
          options_.max_versions_per_model) {
        spdlog::info(
            "model {} version {}: older than the {} restored; removing it",
            name, it->version, restored.size());
        if (absl::Status s = model_store_->Remove(name, it->version); !s.ok()) {
          spdlog::warn("{}", s.ToString());
        }
        continue;
      }
      auto weights = LoadLmHead(it->source);
      if (weights.ok() && weights->sha256 != it->weights_sha256) {
        weights = absl::DataLossError(
            absl::StrCat("weights hash to ", weights->sha256,
                         ", the manifest says ", it->weights_sha256));
      }
      if (!weights.ok()) {
        spdlog::warn("model {} version {} not restored (left on disk): {}",
                     name, it->version, weights.status().ToString());
        continue;
      }
      restored.emplace_back(&*it, *std::move(weights));
    }
    for (auto it = restored.rbegin(); it != restored.rend(); ++it) {
      VersionOrigin origin;
      origin.description = absl::StrCat("restored:", it->first->source.path);
      origin.version = it->first->version;
      origin.on_disk = true;
      auto added = models_->AddVersion(
          name, std::make_shared<const LmHeadWeights>(std::move(it->second)),
          std::move(origin));
      if (!added.ok()) return added.status();
    }
    models_->NumberAbove(name, versions.back().version);
  }
  for (StartupModel& model : models) {
    if (absl::Status s = ValidateModelName(model.name, "--model"); !s.ok())
      return s;
    if (models_->Resolve(model.name, 0).ok()) {
      spdlog::info(
          "model {}: serving the version restored from --model_root, not {}",
          model.name, model.source);
      continue;
    }
    auto weights = model.load();
    if (!weights.ok()) {
      return absl::Status(
          weights.status().code(),
          absl::StrCat("model ", model.name, ": ", weights.status().message()));
    }
    spdlog::info("model {}: H={} V={} V_pad={} bias={} sha256={} ({})",
                 model.name, weights->hidden_size, weights->vocab_size,
                 weights->padded_vocab_size, !weights->bias.empty(),
                 weights->sha256, model.source);
    VersionOrigin origin;
    origin.description = absl::StrCat("startup:", model.source);
    auto added = models_->AddVersion(
        model.name, std::make_shared<const LmHeadWeights>(*std::move(weights)),
        std::move(origin));
    if (!added.ok()) return added.status();
  }
  if (!models_->Resolve("", 0).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--default_model=", models_->default_model(), " is not loaded"));
  }
  return absl::OkStatus();
}

absl::Status Server::StartSharedMemory() {
  SharedMemoryRegistry::Options registry_options;
  registry_options.max_bytes = options_.max_shared_memory_bytes;
  registry_options.idle_release = options_.shared_memory_idle;
  LogpBackend* backend = backend_.get();
  registry_options.pin_host = [backend](void* data, int64_t bytes) {
    return backend->PinHostMemory(data, bytes);
  };
  registry_options.unpin_host = [backend](void* data) {
    backend->UnpinHostMemory(data);
  };
  registry_options.open_ipc = [backend](const std::string& handle, int device,
                                        int64_t bytes) {
    return backend->OpenIpcMemory(handle, device, bytes);
  };
  registry_options.close_ipc = [backend](void* data, int device) {
    backend->CloseIpcMemory(data, device);
  };
  auto registry = SharedMemoryRegistry::Create(std::move(registry_options));
  if (!registry.ok()) return registry.status();
  shared_memory_ = *std::move(registry);
  // Every caller of a loopback listener (and of the Unix socket) is on this
  // host; beyond that it takes the operator's word.
  const bool on_host_only = IsLoopbackListenAddress(options_.host);
  const bool enabled = options_.allow_shared_memory.value_or(on_host_only);
  if (enabled) {
    spdlog::info(
        "shared memory: on for callers on this host (--allow_shared_memory{}; "
        "up to {} bytes, regions unused for {} released)",
        options_.allow_shared_memory.has_value()
            ? ""
            : ", the default: every listener is on this host",
        options_.max_shared_memory_bytes,
        absl::FormatDuration(options_.shared_memory_idle));
  } else {
    spdlog::info(
        "shared memory: off (--allow_shared_memory{}); requests carry their "
        "bytes",
        options_.allow_shared_memory.has_value()
            ? "=false"
            : absl::StrCat(" unset and --host=", options_.host,
                           " is beyond loopback"));
  }
  SharedMemoryServiceImpl::Options service_options;
  service_options.enabled = enabled;
  service_options.authenticator = authenticator_.get();
  service_options.on_call_done = CountCallsInto(metrics_.get());
  shared_memory_service_ = std::make_unique<SharedMemoryServiceImpl>(
      service_options, shared_memory_.get());
  return absl::OkStatus();
}

void Server::BuildLogProbService() {
  LogProbServiceImpl::Options service_options;
  service_options.max_request_rows = options_.max_request_rows;
  service_options.max_top_k = options_.max_top_k;
  service_options.extras_unavailable =
      backend_->description().extras_unavailable;
  spdlog::info(
      "requests: up to {} rows (--max_request_rows), entropy on "
      "request, top_k up to {} (--max_top_k; kernels allow {})",
      options_.max_request_rows, options_.max_top_k, kernels::kMaxTopK);
  service_options.max_stream_inflight_requests =
      options_.max_stream_inflight_requests;
  service_options.on_call_done = CountCallsInto(metrics_.get());
  ServerMetrics* metrics = metrics_.get();
  service_options.on_rows_answered = [metrics](absl::string_view model,
                                               int64_t rows) {
    metrics->CountModelRows(model, rows);
  };
  service_options.authenticator = authenticator_.get();
  service_options.on_hidden_bytes = [metrics](absl::string_view path,
                                              int64_t bytes) {
    metrics->CountHiddenBytes(path, bytes);
  };
  service_options.max_receive_message_bytes = options_.max_message_bytes;
  if (shared_memory_service_ != nullptr && shared_memory_service_->enabled()) {
    service_options.shared_memory = shared_memory_.get();
  }
  logprob_service_ = std::make_unique<LogProbServiceImpl>(
      service_options, models_.get(), batcher_.get());
}

void Server::BuildRepositoryService() {
  ModelRepositoryServiceImpl::Options repository_options;
  repository_options.admin_authenticator = admin_authenticator_.get();
  repository_options.allow_without_admin_token = IsLoopbackHost(options_.host);
  repository_options.store = model_store_.get();
  repository_options.peer_credentials = peer_credentials_;
  repository_options.on_call_done = CountCallsInto(metrics_.get());
  repository_options.on_upload_bytes =
      [metrics = metrics_.get()](absl::string_view from, int64_t bytes) {
        metrics->CountModelBytesReceived(from, bytes);
      };
  repository_service_ = std::make_unique<ModelRepositoryServiceImpl>(
      repository_options, models_.get());
  if (admin_authenticator_ == nullptr && !IsLoopbackHost(options_.host)) {
    spdlog::warn(
        "no --admin_tokens_file: ModelRepositoryService refuses every "
        "call (the server listens on {}, beyond loopback)",
        options_.host);
  }
}

absl::Status Server::StartProjection(ProjectionWeights weights) {
  projection_weights_ = std::make_unique<ProjectionWeights>(std::move(weights));
  // The same --device as the log-prob backend.
  ProjectionBackendRegistry registry;
  RegisterBuiltinBackends(&registry);
  ProjectionBackendOptions backend_options;
  backend_options.weights = projection_weights_.get();
  backend_options.cpu_threads = options_.cpu_threads;
  backend_options.max_cached_host_buffer_bytes =
      options_.projection_chunk_cache_bytes;
  std::vector<std::string> notes;
  auto backend = registry.Create(options_.device, backend_options, &notes);
  if (!backend.ok()) return backend.status();
  projection_backend_ = *std::move(backend);

  ServerMetrics* metrics = metrics_.get();
  ProjectionScheduler::Options scheduler_options;
  scheduler_options.max_launch_rows = options_.projection_max_launch_rows;
  scheduler_options.num_threads =
      options_.projection_threads > 0
          ? options_.projection_threads
          : projection_backend_->description().preferred_inflight_batches;
  scheduler_options.on_launch =
      [metrics](const ProjectionScheduler::LaunchTimings& t) {
        metrics->ObserveProjectionLaunch(t.rows, t.queue_delay_seconds,
                                         t.run_seconds, t.copy_out_seconds);
      };
  auto scheduler =
      ProjectionScheduler::Create(scheduler_options, projection_backend_.get());
  if (!scheduler.ok()) return scheduler.status();
  projection_scheduler_ = *std::move(scheduler);

  ProjectionServiceImpl::Options projection_options;
  projection_options.default_rows_per_chunk =
      options_.projection_default_rows_per_chunk;
  projection_options.max_stream_buffer_bytes =
      options_.projection_stream_buffer_bytes;
  projection_options.determinism_key =
      ProjectionDeterminismKey(*projection_weights_);
  projection_options.on_call_done = CountCallsInto(metrics);
  projection_options.authenticator = authenticator_.get();
  projection_options.chunk_buffers = projection_backend_->host_buffer_pool();
  projection_options.on_stream_timings =
      [metrics](const ProjectionServiceImpl::StreamTimings& t) {
        metrics->ObserveProjectionStream(t.chunks, t.write_seconds,
                                         t.waited_for_compute_seconds);
      };
  projection_service_ = std::make_unique<ProjectionServiceImpl>(
      projection_options, projection_scheduler_.get());
  spdlog::info("projection: {} on {} (kernel {}, key {})",
               projection_weights_->description,
               projection_backend_->description().device,
               projection_backend_->description().kernel_version,
               projection_options.determinism_key);
  return absl::OkStatus();
}

absl::Status Server::StartListeners(
    const std::shared_ptr<grpc::ServerCredentials>& tcp_credentials) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address =
      absl::StrCat(BracketedHost(options_.host), ":", options_.port);
  builder.AddListeningPort(address, tcp_credentials, &port_);
  if (!options_.unix_socket_path.empty()) {
    if (absl::Status s =
            PrepareUnixSocketPath(options_.unix_socket_path, "--unix_socket");
        !s.ok()) {
      return s;
    }
    // Plaintext, as local sockets of system services are: who may connect is
    // the socket file's mode; bearer tokens still apply to every call.
    builder.AddListeningPort(UnixSocketAddress(options_.unix_socket_path),
                             grpc::InsecureServerCredentials());
  }
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             options_.max_concurrent_streams_per_connection);
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  builder.RegisterService(logprob_service_.get());
  builder.RegisterService(repository_service_.get());
  builder.RegisterService(projection_service_.get());
  builder.RegisterService(shared_memory_service_.get());
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", address,
        options_.unix_socket_path.empty()
            ? ""
            : absl::StrCat(" and ",
                           UnixSocketAddress(options_.unix_socket_path))));
  }
  // Listening is not serving: health says SERVING once every step is done.
  grpc_server_->GetHealthCheckService()->SetServingStatus(false);
  return absl::OkStatus();
}

absl::Status Server::StartMetricsEndpoint() {
  if (options_.metrics_port < 0) return absl::OkStatus();
  MetricsHttpServer::Options metrics_options;
  metrics_options.host = options_.host;
  metrics_options.port = options_.metrics_port;
  metrics_options.render = [this] { return RenderMetrics(); };
  auto http = MetricsHttpServer::Start(metrics_options);
  if (!http.ok()) return http.status();
  metrics_http_ = *std::move(http);
  spdlog::info("metrics on http://{}:{}/metrics", BracketedHost(options_.host),
               metrics_http_->port());
  return absl::OkStatus();
}

absl::Status Server::MakePeerCredentials() {
  if (options_.tls_cert_path.empty()) return absl::OkStatus();
  const bool own = options_.peer_tls_ca_path.empty();
  auto roots = ReadPem(own ? options_.tls_cert_path : options_.peer_tls_ca_path,
                       own ? "--tls_cert" : "--peer_tls_ca");
  if (!roots.ok()) return roots.status();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = *std::move(roots);
  peer_credentials_ = grpc::SslCredentials(ssl);
  return absl::OkStatus();
}

absl::Status Server::PullFromPeers() {
  if (options_.pull_from.empty()) return absl::OkStatus();
  PeerPullOptions pull;
  pull.peers = options_.pull_from;
  pull.download_timeout = options_.pull_timeout;
  pull.credentials = peer_credentials_;
  if (!options_.admin_tokens_path.empty()) {
    auto token = FirstTokenIn(options_.admin_tokens_path);
    if (!token.ok()) return token.status();
    pull.admin_token = *std::move(token);
  }
  pull.on_bytes = [metrics = metrics_.get()](absl::string_view from,
                                             int64_t bytes) {
    metrics->CountModelBytesReceived(from, bytes);
  };
  const absl::Time start = absl::Now();
  auto report = server::PullFromPeers(pull, models_.get(), model_store_.get());
  if (!report.ok()) return report.status();
  spdlog::info("pull on start: {} in {:.3f} s",
               report->pulled.empty() ? "nothing newer on any peer"
                                      : absl::StrJoin(report->pulled, ", "),
               absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

void Server::ReportServing() {
  grpc::HealthCheckServiceInterface* health =
      grpc_server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kLogProbServiceName, true);
  health->SetServingStatus(kProjectionServiceName, true);
  health->SetServingStatus(kRepositoryServiceName, true);
  const detlogp::v1::ModelInfo info = model_info();
  spdlog::info(
      "serving model {} v{} (default) and {} other(s) on {}:{}{} "
      "(determinism key {}; {}, {})",
      info.model(), info.model_version(), models_->DescribeAll().size() - 1,
      options_.host, port_,
      options_.unix_socket_path.empty()
          ? ""
          : " and " + UnixSocketAddress(options_.unix_socket_path) +
                " (plaintext)",
      info.determinism_key(),
      options_.tls_cert_path.empty()        ? "plaintext"
      : options_.tls_client_ca_path.empty() ? "TLS"
                                            : "mutual TLS",
      authenticator_ ? "bearer tokens required" : "no authentication");
}

detlogp::v1::ModelInfo Server::model_info() const {
  auto info = models_->Describe("", 0);
  return info.ok() ? *std::move(info) : detlogp::v1::ModelInfo();
}

std::string Server::RenderMetrics() const {
  const DynamicBatcher::Stats stats = batcher_->stats();
  MetricsSnapshot snapshot;
  snapshot.rows_computed = stats.rows_computed;
  snapshot.rows_failed = stats.rows_failed;
  snapshot.rows_expired = stats.rows_expired;
  snapshot.rows_cancelled = stats.rows_cancelled;
  snapshot.rows_rejected = stats.rows_rejected;
  snapshot.queue_rows = stats.rows_queued;
  snapshot.queue_capacity_rows = batcher_->queue_capacity_rows();
  snapshot.device_memory_used_bytes = backend_->DeviceMemoryUsedBytes();
  for (const detlogp::v1::ModelInfo& info : models_->DescribeAll()) {
    MetricsSnapshot::Model model;
    model.name = info.model();
    model.latest_version = info.model_version();
    for (const auto& version : info.versions()) {
      model.ready_versions +=
          version.state() == detlogp::v1::ModelVersionStatus::READY;
    }
    snapshot.models.push_back(std::move(model));
  }
  snapshot.model_memory_bytes = models_->reserved_bytes();
  if (projection_service_ != nullptr) {
    const HostBufferPool::Stats pool =
        projection_service_->chunk_buffer_stats();
    MetricsSnapshot::ChunkBuffers& buffers = snapshot.chunk_buffers;
    buffers.cached = pool.reused;
    buffers.allocated = pool.allocated;
    buffers.heap = pool.heap_fallbacks;
    buffers.freed = pool.freed;
    buffers.cache_bytes = pool.cached_bytes;
  }
  if (shared_memory_ != nullptr) {
    const SharedMemoryRegistry::Totals totals = shared_memory_->totals();
    snapshot.shared_memory = {totals.system_regions, totals.system_bytes,
                              totals.cuda_regions, totals.cuda_bytes,
                              totals.idle_released};
  }
  return metrics_->Render(snapshot);
}

void Server::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (grpc_server_ != nullptr) {
    grpc::HealthCheckServiceInterface* health =
        grpc_server_->GetHealthCheckService();
    health->SetServingStatus(false);
    // Refuses new calls; waits for accepted ones, which the batcher keeps
    // running, until the grace period ends.
    grpc_server_->Shutdown(
        absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  }
  if (projection_scheduler_ != nullptr) projection_scheduler_->Stop();
  if (batcher_ == nullptr) return;
  batcher_->Stop();
  metrics_http_.reset();
  const DynamicBatcher::Stats stats = batcher_->stats();
  spdlog::info(
      "stopped: {} batches, {} rows computed, {} expired, {} cancelled, {} "
      "rejected",
      stats.batches_run, stats.rows_computed, stats.rows_expired,
      stats.rows_cancelled, stats.rows_rejected);
}

Server::~Server() { Shutdown(); }

}  // namespace detlogp::server
