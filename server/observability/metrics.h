// Prometheus metrics of the server, rendered in the text exposition format
// (served by MetricsHttpServer on --metrics_port).
//
//   detlogp_requests_total{method,code}      calls finished, by gRPC code
//   detlogp_rows_total{outcome}              rows: computed, failed, expired,
//                                            cancelled, rejected
//   detlogp_batch_rows                       histogram of rows per batch
//   detlogp_batch_requests                   histogram of request slices per batch
//   detlogp_queue_delay_seconds              histogram: oldest slice's wait
//   detlogp_gather_seconds                   histogram: staging a batch's rows
//   detlogp_compute_seconds                  histogram: backend time per batch
//   detlogp_queue_rows                       gauge: rows waiting now
//   detlogp_device_memory_used_bytes         gauge: GPU memory in use (0 on CPU)
//   detlogp_model_rows_total{model}          rows answered, by model
//   detlogp_model_latest_version{model}      gauge: newest ready version
//   detlogp_model_ready_versions{model}      gauge: versions answering requests
//   detlogp_model_memory_bytes               gauge: bytes held by model versions
#ifndef DETLOGP_SERVER_OBSERVABILITY_METRICS_H_
#define DETLOGP_SERVER_OBSERVABILITY_METRICS_H_

#include <atomic>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace detlogp::server {

// A cumulative histogram with fixed upper bounds.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double value);
  // Appends the _bucket, _sum and _count lines of `name`.
  void Render(absl::string_view name, std::string* out) const;

 private:
  const std::vector<double> upper_bounds_;
  mutable absl::Mutex mu_;
  std::vector<int64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, +Inf last
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Point-in-time values the server reads from its parts at scrape time.
struct MetricsSnapshot {
  int64_t rows_computed = 0;
  int64_t rows_failed = 0;
  int64_t rows_expired = 0;
  int64_t rows_cancelled = 0;
  int64_t rows_rejected = 0;
  int64_t queue_rows = 0;
  int64_t device_memory_used_bytes = 0;
  struct Model {
    std::string name;
    int64_t latest_version = 0;
    int64_t ready_versions = 0;
  };
  std::vector<Model> models;
  int64_t model_memory_bytes = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();

  void CountRequest(absl::string_view method, int grpc_code);
  void CountModelRows(absl::string_view model, int64_t rows);
  void ObserveBatch(int64_t rows, int64_t requests, double queue_delay_seconds,
                    double gather_seconds, double compute_seconds);
  std::string Render(const MetricsSnapshot& snapshot) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, int64_t> requests_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t, std::less<>> model_rows_ ABSL_GUARDED_BY(mu_);
  Histogram batch_rows_;
  Histogram batch_requests_;
  Histogram queue_delay_seconds_;
  Histogram gather_seconds_;
  Histogram compute_seconds_;
};

// Canonical upper-case name of a gRPC status code ("OK", "INVALID_ARGUMENT").
const char* GrpcCodeName(int code);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_OBSERVABILITY_METRICS_H_
