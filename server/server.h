// The detlogp server: backends chosen by name, the dynamic batcher, the
// model manager (named lm_head models with live versions), the projection
// scheduler and the gRPC services (LogProbService, ModelRepositoryService,
// ProjectionService, health, reflection), started and stopped as one unit.
//
// Start-up: the backend is created (--device); every model is restored from
// --model_root (its latest complete version) or loaded from its start-up
// source, placed and warmed up through the batcher; with --pull_from, the
// newest versions a peer serves are copied; only then does health report
// SERVING. Shutdown: health
// goes NOT_SERVING, new calls are refused, every accepted call is answered,
// then the batcher's threads are joined.
#ifndef DETLOGP_SERVER_SERVER_H_
#define DETLOGP_SERVER_SERVER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "detlogp/v1/detlogp.pb.h"
#include "server/backends/backend.h"
#include "server/backends/projection_backend.h"
#include "server/batching/batcher.h"
#include "server/batching/projection_scheduler.h"
#include "server/models/lm_head_weights.h"
#include "server/models/model_manager.h"
#include "server/models/model_store.h"
#include "server/models/projection_weights.h"
#include "server/observability/metrics.h"
#include "server/observability/metrics_http_server.h"
#include "server/shared_memory/region_registry.h"
#include "server/transport/auth.h"
#include "server/transport/logprob_service.h"
#include "server/transport/model_repository_service.h"
#include "server/transport/projection_service.h"
#include "server/transport/shared_memory_service.h"

namespace detlogp::server {

// A model named on the command line. Loaded at start-up unless --model_root
// holds versions of it, in which case its latest stored version serves.
struct StartupModel {
  std::string name;
  std::string source;  // for logs and ModelVersionStatus.source
  std::function<absl::StatusOr<LmHeadWeights>()> load;
};

class Server {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int port = 50051;  // 0 picks a free port; see port()
    // Also listen on this Unix-domain socket (same services and bearer
    // tokens, plaintext even when the TCP port has TLS); empty: TCP only.
    // Who may connect is the socket file's mode, set by the process's umask
    // (connecting needs write permission).
    std::string unix_socket_path;
    // Largest message either way; the default fits a request of 65,536 x
    // 4,096 bf16 rows with its targets (ModelInfo reports it, so clients
    // cut larger calls).
    int max_message_bytes = 640 << 20;
    int64_t max_request_rows = 65536;
    // Largest top_k a request may ask for; 0 .. kernels::kMaxTopK.
    int64_t max_top_k = 20;
    int max_stream_inflight_requests = 64;
    // "auto", "cpu" or "cuda:N".
    std::string device = "auto";
    // With several GPUs ("cuda:all"): each holds a share of the vocabulary.
    bool vocab_parallel = false;
    // Which CUDA linear-logp kernel: "auto" (Hopper on compute capability
    // 9.0, portable on other GPUs >= 8.0), "hopper" or "portable"
    // (server/backends/cuda_device_selection.h). A forced kernel never falls
    // back to the CPU.
    std::string logp_kernel = "auto";
    int cpu_threads = 0;  // 0: one per hardware thread
    // max_batch_rows, max_queue_delay_micros and idle_spin_micros -1 and
    // num_batch_threads 0 mean the backend's preference
    // (min_rows_to_overlap -1: max_batch_rows / 4).
    DynamicBatcher::Options batcher{-1, -1, 1 << 20, 0, -1, -1};
    // How long Shutdown waits for accepted calls before cancelling them.
    absl::Duration shutdown_grace = absl::Seconds(30);
    // Prometheus endpoint on `host`: -1 off, 0 a free port, else that port.
    int metrics_port = -1;
    // TLS through gRPC's credentials: PEM paths set by the operator. With a
    // client CA, clients must present a certificate it signed (mutual TLS).
    std::string tls_cert_path;
    std::string tls_key_path;
    std::string tls_client_ca_path;
    // A file of bearer tokens; empty means no authentication.
    std::string auth_tokens_path;
    // Tokens for ModelRepositoryService; empty: admin calls only when the
    // server listens on loopback.
    std::string admin_tokens_path;
    // The model an empty request.model means; empty: the first start-up
    // model.
    std::string default_model;
    // Where LoadModel reads and uploaded versions are kept; empty: none.
    std::string model_root;
    int max_versions_per_model = 2;
    int64_t max_model_memory_bytes = 0;  // 0: no bound
    // A staged version (two-phase publish) not committed within this is
    // dropped.
    absl::Duration staged_version_timeout = absl::Seconds(60);
    // Pull on start: peers ("host:port") asked for the current versions
    // before health reports SERVING (peer_pull.h); empty: no pull. Calls
    // carry the first token of admin_tokens_path.
    std::vector<std::string> pull_from;
    // With TLS: PEM roots peers' certificates (pulls, chain pushes) are
    // checked against; empty: tls_cert_path itself (one certificate every
    // replica shares).
    std::string peer_tls_ca_path;
    // Bound on the pull's download.
    absl::Duration pull_timeout = absl::Minutes(10);
    // HTTP/2 streams one connection may have open at once.
    int max_concurrent_streams_per_connection = 256;
    // SharedMemoryService and Tensor.shared_memory for callers on this host
    // (docs/shared_memory.md). Unset: on when every listener is on this
    // host (loopback --host; the Unix socket always is), off otherwise.
    std::optional<bool> allow_shared_memory;
    // Bytes all registered regions may span together.
    int64_t max_shared_memory_bytes = int64_t{64} << 30;
    // A region unused this long is released; zero: never.
    absl::Duration shared_memory_idle = absl::Seconds(300);
    // Projection rows per launch; also the largest rows_per_chunk.
    int64_t projection_max_launch_rows = 2048;
    // Projection launches in flight (each its own staging and GPU stream);
    // 0: the projection backend's preference.
    int projection_threads = 0;
    int64_t projection_default_rows_per_chunk = 512;
    int64_t projection_stream_buffer_bytes = int64_t{64} << 20;
    // Bytes of released projection chunk buffers kept for reuse by a
    // backend that allocates its own (CUDA: pinned memory).
    int64_t projection_chunk_cache_bytes = int64_t{1} << 30;
  };

  static absl::StatusOr<std::unique_ptr<Server>> BuildAndStart(
      const Options& options, std::vector<StartupModel> models,
      ProjectionWeights projection_weights);

  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // The metrics endpoint's port, or 0 when off.
  int metrics_port() const {
    return metrics_http_ != nullptr ? metrics_http_->port() : 0;
  }
  // The default model's latest version.
  detlogp::v1::ModelInfo model_info() const;
  ModelManager* models() { return models_.get(); }
  DynamicBatcher::Stats batcher_stats() const { return batcher_->stats(); }

  // Stops accepting calls, answers every accepted call, stops the batcher.
  void Shutdown();

  // The Prometheus text of GET /metrics.
  std::string RenderMetrics() const;

 private:
  Server() = default;

  // The start-up steps, in the order BuildAndStart runs them. Each fills
  // the members it names and reads only those built before it.
  static absl::Status ValidateOptions(const Options& options,
                                      const std::vector<StartupModel>& models);
  // --auth_tokens_file and --admin_tokens_file.
  absl::Status LoadAuthenticators();
  // The log-prob backend named by --device.
  absl::Status CreateBackend();
  // The batcher, its unset options taken from the backend's preferences.
  absl::Status CreateBatcher();
  // --model_root, when set.
  absl::Status OpenModelStore();
  absl::Status CreateModelManager(const std::string& default_model);
  // Restores stored versions, then loads start-up models not restored;
  // fails when the default model is not among them.
  absl::Status LoadModels(std::vector<StartupModel> models);
  // The region registry (with the backend's hooks) and SharedMemoryService.
  absl::Status StartSharedMemory();
  void BuildLogProbService();
  void BuildRepositoryService();
  // The projection backend (same --device), its scheduler and service.
  absl::Status StartProjection(ProjectionWeights weights);
  // The TCP port (and the Unix socket), every service registered; health
  // reports NOT_SERVING until ReportServing.
  absl::Status StartListeners(
      const std::shared_ptr<grpc::ServerCredentials>& tcp_credentials);
  // The Prometheus endpoint, when --metrics_port >= 0.
  absl::Status StartMetricsEndpoint();
  // Health goes SERVING for the server and every service.
  // With TLS: how this server reaches its peers (chain pushes, pulls).
  absl::Status MakePeerCredentials();
  // Copies the newest versions from --pull_from before ReportServing.
  absl::Status PullFromPeers();
  void ReportServing();

  Options options_;
  // Before the batcher and services, which report into it.
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<TokenAuthenticator> authenticator_;
  std::unique_ptr<TokenAuthenticator> admin_authenticator_;
  // Null: plaintext to peers.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials_;
  std::unique_ptr<LogpBackend> backend_;
  // After the backend (its regions are pinned or opened through it), before
  // the batcher (whose requests hold regions until answered).
  std::unique_ptr<SharedMemoryRegistry> shared_memory_;
  std::unique_ptr<DynamicBatcher> batcher_;
  std::unique_ptr<ModelStore> model_store_;
  // After the batcher: versions free their device memory before the
  // backend goes.
  std::unique_ptr<ModelManager> models_;
  std::unique_ptr<LogProbServiceImpl> logprob_service_;
  std::unique_ptr<ModelRepositoryServiceImpl> repository_service_;
  std::unique_ptr<SharedMemoryServiceImpl> shared_memory_service_;
  std::unique_ptr<ProjectionWeights> projection_weights_;
  std::unique_ptr<ProjectionBackend> projection_backend_;
  std::unique_ptr<ProjectionScheduler> projection_scheduler_;
  std::unique_ptr<ProjectionServiceImpl> projection_service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_SERVER_H_
