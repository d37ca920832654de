#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "kernels/split_policy.h"
#include "server/models/determinism_key.h"
#include "spdlog/spdlog.h"

namespace detlogp::server {
namespace {

constexpr char kLogProbServiceName[] = "detlogp.v1.LogProbService";
constexpr char kProjectionServiceName[] = "detlogp.v1.ProjectionService";

detlogp::v1::ModelInfo DescribeModel(const LmHeadWeights& weights,
                                     const BackendDescription& backend) {
  detlogp::v1::ModelInfo info;
  info.set_hidden_size(weights.hidden_size);
  info.set_vocab_size(weights.vocab_size);
  info.set_padded_vocab_size(weights.padded_vocab_size);
  info.set_weight_dtype(detlogp::v1::DTYPE_BFLOAT16);
  info.set_has_bias(!weights.bias.empty());
  info.set_weights_sha256(weights.sha256);
  info.set_backend(absl::StrCat(backend.name, " (", backend.device, ")"));
  info.set_kernel_version(backend.kernel_version);
  info.set_split_policy(kernels::kSplitPolicyName);
  info.set_determinism_key(DeterminismKey({weights.sha256, backend.name,
                                           backend.instruction_set,
                                           backend.kernel_version,
                                           kernels::kSplitPolicyName}));
  return info;
}

// Runs one batch end to end so that the first real call pays no start-up
// cost and a broken backend is found before health says SERVING.
absl::Status WarmUp(DynamicBatcher* batcher, const LmHeadWeights& weights) {
  const int64_t rows = 2;
  std::vector<uint16_t> hidden(rows * weights.hidden_size, 0x3f80);  // 1.0
  std::vector<int32_t> targets = {0, static_cast<int32_t>(weights.vocab_size - 1)};
  absl::Notification done;
  absl::Status result;
  auto job = std::make_shared<LogpJob>(
      rows, weights.hidden_size, std::move(hidden), std::move(targets), 1.0f,
      absl::InfiniteFuture(),
      [&](absl::Status status, LogpJob&) {
        result = status;
        done.Notify();
      });
  if (absl::Status s = batcher->Schedule(job); !s.ok()) return s;
  done.WaitForNotification();
  return result;
}

// The projection's key names its arithmetic, not its backend: CPU and CUDA
// compute the same fixed fma chain and give identical bits (tested on the
// GPU), so they share a key.
std::string ProjectionDeterminismKey(const ProjectionWeights& weights) {
  return DeterminismKey({weights.sha256, "h3-projection", "ieee-fp32-fma",
                         "fma-chain-k-ascending-then-bias/v1", "rows-independent"});
}

// Creates the projection backend (same --device as the log-prob backend) and
// its scheduler.
absl::Status StartProjection(const Server::Options& options,
                             const ProjectionWeights* weights,
                             std::unique_ptr<ProjectionBackend>* backend,
                             std::unique_ptr<ProjectionScheduler>* scheduler) {
  ProjectionBackendRegistry registry;
  RegisterBuiltinBackends(&registry);
  ProjectionBackendOptions backend_options;
  backend_options.weights = weights;
  backend_options.cpu_threads = options.cpu_threads;
  std::vector<std::string> notes;
  auto created = registry.Create(options.device, backend_options, &notes);
  if (!created.ok()) return created.status();
  *backend = *std::move(created);
  ProjectionScheduler::Options scheduler_options;
  scheduler_options.max_launch_rows = options.projection_max_launch_rows;
  scheduler_options.num_threads = (*backend)->description().preferred_inflight_batches;
  auto made = ProjectionScheduler::Create(scheduler_options, backend->get());
  if (!made.ok()) return made.status();
  *scheduler = *std::move(made);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
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
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
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

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::BuildAndStart(
    const Options& options, LmHeadWeights weights,
    ProjectionWeights projection_weights) {
  std::unique_ptr<Server> server(new Server());
  server->options_ = options;
  server->weights_ = std::make_unique<LmHeadWeights>(std::move(weights));
  server->metrics_ = std::make_unique<ServerMetrics>();
  ServerMetrics* metrics = server->metrics_.get();
  auto credentials = MakeCredentials(options);
  if (!credentials.ok()) return credentials.status();
  if (!options.auth_tokens_path.empty()) {
    auto authenticator = TokenAuthenticator::FromFile(options.auth_tokens_path);
    if (!authenticator.ok()) return authenticator.status();
    server->authenticator_ = *std::move(authenticator);
  }

  LogpBackendRegistry registry;
  RegisterBuiltinBackends(&registry);
  BackendOptions backend_options;
  backend_options.weights = server->weights_.get();
  backend_options.cpu_threads = options.cpu_threads;
  backend_options.vocab_parallel = options.vocab_parallel;
  std::vector<std::string> notes;
  auto backend = registry.Create(options.device, backend_options, &notes);
  for (const std::string& note : notes) spdlog::info("{}", note);
  if (!backend.ok()) return backend.status();
  server->backend_ = *std::move(backend);
  const BackendDescription& description = server->backend_->description();
  spdlog::info("backend {} on {} (kernel {}, isa {})", description.name,
               description.device, description.kernel_version,
               description.instruction_set);

  DynamicBatcher::Options batcher_options = options.batcher;
  if (batcher_options.num_batch_threads <= 0) {
    batcher_options.num_batch_threads = description.preferred_inflight_batches;
  }
  if (batcher_options.idle_spin_micros < 0) {
    batcher_options.idle_spin_micros = description.preferred_idle_spin_micros;
  }
  batcher_options.on_batch = [metrics](const DynamicBatcher::BatchRecord& r) {
    metrics->ObserveBatch(r.rows, r.requests,
                          absl::ToDoubleSeconds(r.queue_delay),
                          absl::ToDoubleSeconds(r.gather),
                          absl::ToDoubleSeconds(r.compute));
  };
  auto batcher =
      DynamicBatcher::Create(batcher_options, server->backend_.get());
  if (!batcher.ok()) return batcher.status();
  server->batcher_ = *std::move(batcher);

  server->info_ = DescribeModel(*server->weights_, description);
  LogProbServiceImpl::Options service_options;
  service_options.limits.hidden_size = server->weights_->hidden_size;
  service_options.limits.vocab_size = server->weights_->vocab_size;
  service_options.limits.max_request_rows = options.max_request_rows;
  service_options.max_stream_inflight_requests =
      options.max_stream_inflight_requests;
  service_options.on_call_done = [metrics](absl::string_view method, int code) {
    metrics->CountRequest(method, code);
  };
  service_options.authenticator = server->authenticator_.get();
  server->logprob_service_ = std::make_unique<LogProbServiceImpl>(
      service_options, server->info_, server->batcher_.get());

  server->projection_weights_ =
      std::make_unique<ProjectionWeights>(std::move(projection_weights));
  if (absl::Status s = StartProjection(options,
                                       server->projection_weights_.get(),
                                       &server->projection_backend_,
                                       &server->projection_scheduler_);
      !s.ok()) {
    return s;
  }
  ProjectionServiceImpl::Options projection_options;
  projection_options.default_rows_per_chunk =
      options.projection_default_rows_per_chunk;
  projection_options.determinism_key =
      ProjectionDeterminismKey(*server->projection_weights_);
  projection_options.on_call_done = service_options.on_call_done;
  projection_options.authenticator = server->authenticator_.get();
  server->projection_service_ = std::make_unique<ProjectionServiceImpl>(
      projection_options, server->projection_scheduler_.get());
  spdlog::info("projection: {} on {} (kernel {}, key {})",
               server->projection_weights_->description,
               server->projection_backend_->description().device,
               server->projection_backend_->description().kernel_version,
               projection_options.determinism_key);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(
      options.host.find(':') != std::string::npos ? "[" + options.host + "]"
                                                  : options.host,
      ":", options.port);
  builder.AddListeningPort(address, *credentials, &server->port_);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             options.max_concurrent_streams_per_connection);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(server->logprob_service_.get());
  builder.RegisterService(server->projection_service_.get());
  server->grpc_server_ = builder.BuildAndStart();
  if (server->grpc_server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address));
  }
  grpc::HealthCheckServiceInterface* health =
      server->grpc_server_->GetHealthCheckService();
  health->SetServingStatus(false);

  if (absl::Status s = WarmUp(server->batcher_.get(), *server->weights_);
      !s.ok()) {
    return absl::InternalError(
        absl::StrCat("warm-up batch failed: ", s.message()));
  }
  if (options.metrics_port >= 0) {
    MetricsHttpServer::Options metrics_options;
    metrics_options.host = options.host;
    metrics_options.port = options.metrics_port;
    Server* raw = server.get();
    metrics_options.render = [raw] { return raw->RenderMetrics(); };
    auto http = MetricsHttpServer::Start(metrics_options);
    if (!http.ok()) return http.status();
    server->metrics_http_ = *std::move(http);
    spdlog::info("metrics on http://{}:{}/metrics", options.host,
                 server->metrics_http_->port());
  }
  health->SetServingStatus(true);
  health->SetServingStatus(kLogProbServiceName, true);
  health->SetServingStatus(kProjectionServiceName, true);
  spdlog::info("serving {} on {}:{} (determinism key {}; {}, {})",
               server->weights_->description, options.host, server->port_,
               server->info_.determinism_key(),
               options.tls_cert_path.empty() ? "plaintext"
               : options.tls_client_ca_path.empty() ? "TLS" : "mutual TLS",
               server->authenticator_ ? "bearer tokens required"
                                      : "no authentication");
  return server;
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
  snapshot.device_memory_used_bytes = backend_->DeviceMemoryUsedBytes();
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
    grpc_server_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  }
  if (projection_scheduler_ != nullptr) projection_scheduler_->Stop();
  if (batcher_ == nullptr) return;
  batcher_->Stop();
  metrics_http_.reset();
  const DynamicBatcher::Stats stats = batcher_->stats();
  spdlog::info("stopped: {} batches, {} rows computed, {} expired, {} cancelled, {} rejected",
               stats.batches_run, stats.rows_computed, stats.rows_expired,
               stats.rows_cancelled, stats.rows_rejected);
}

Server::~Server() { Shutdown(); }

}  // namespace detlogp::server
