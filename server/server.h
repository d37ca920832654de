// The detlogp server: weights, backends chosen by name, the dynamic batcher,
// the projection scheduler and the gRPC services (LogProbService,
// ProjectionService, health, reflection), started and stopped as one unit.
//
// Start-up: the backend is created (--device), a warm-up batch runs through
// the batcher, and only then does health report SERVING. Shutdown: health
// goes NOT_SERVING, new calls are refused, every accepted call is answered,
// then the batcher's threads are joined.
#ifndef DETLOGP_SERVER_SERVER_H_
#define DETLOGP_SERVER_SERVER_H_

#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "detlogp/v1/detlogp.pb.h"
#include "server/backends/backend.h"
#include "server/backends/projection_backend.h"
#include "server/batching/batcher.h"
#include "server/batching/projection_scheduler.h"
#include "server/models/lm_head_weights.h"
#include "server/models/projection_weights.h"
#include "server/observability/metrics.h"
#include "server/observability/metrics_http_server.h"
#include "server/transport/auth.h"
#include "server/transport/logprob_service.h"
#include "server/transport/projection_service.h"

namespace detlogp::server {

class Server {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int port = 50051;  // 0 picks a free port; see port()
    // Largest message either way; the default fits 8192 x 4096 bf16 rows
    // and a 364,608-row H3 video input (140 MB).
    int max_message_bytes = 160 << 20;
    int64_t max_request_rows = 65536;
    int max_stream_inflight_requests = 64;
    // "auto", "cpu" or "cuda:N".
    std::string device = "auto";
    // With several GPUs ("cuda:all"): each holds a share of the vocabulary.
    bool vocab_parallel = false;
    int cpu_threads = 0;  // 0: one per hardware thread
    // num_batch_threads 0 and idle_spin_micros -1 mean the backend's
    // preference (min_rows_to_overlap -1: max_batch_rows / 4).
    DynamicBatcher::Options batcher{256, 500, 1 << 16, 0, -1, -1};
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
    // HTTP/2 streams one connection may have open at once.
    int max_concurrent_streams_per_connection = 256;
    // Projection rows per launch; also the largest rows_per_chunk.
    int64_t projection_max_launch_rows = 2048;
    int64_t projection_default_rows_per_chunk = 512;
  };

  static absl::StatusOr<std::unique_ptr<Server>> BuildAndStart(
      const Options& options, LmHeadWeights weights,
      ProjectionWeights projection_weights);

  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // The metrics endpoint's port, or 0 when off.
  int metrics_port() const {
    return metrics_http_ != nullptr ? metrics_http_->port() : 0;
  }
  const detlogp::v1::ModelInfo& model_info() const { return info_; }
  DynamicBatcher::Stats batcher_stats() const { return batcher_->stats(); }

  // Stops accepting calls, answers every accepted call, stops the batcher.
  void Shutdown();

  // The Prometheus text of GET /metrics.
  std::string RenderMetrics() const;

 private:
  Server() = default;

  Options options_;
  std::unique_ptr<LmHeadWeights> weights_;
  // Before the batcher and services, which report into it.
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<TokenAuthenticator> authenticator_;
  std::unique_ptr<LogpBackend> backend_;
  std::unique_ptr<DynamicBatcher> batcher_;
  std::unique_ptr<LogProbServiceImpl> logprob_service_;
  std::unique_ptr<ProjectionWeights> projection_weights_;
  std::unique_ptr<ProjectionBackend> projection_backend_;
  std::unique_ptr<ProjectionScheduler> projection_scheduler_;
  std::unique_ptr<ProjectionServiceImpl> projection_service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  detlogp::v1::ModelInfo info_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_SERVER_H_
