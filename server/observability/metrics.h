// Prometheus metrics of the server, kept in prometheus-cpp's metric types
// and rendered by its text serializer (Debian's prometheus-cpp-dev, core
// library); served by MetricsHttpServer on --metrics_port.
//
//   detlogp_requests_total{method,code}      calls finished, by gRPC code
//   detlogp_rows_total{outcome}              rows: computed, failed, expired,
//                                            cancelled, rejected
//   detlogp_rows_{computed,expired,cancelled,rejected}_total
//                                            the same, flat (alerts, scripts)
//   detlogp_batch_rows                       histogram of rows per batch
//   detlogp_batch_requests                   histogram of request slices per
//   batch detlogp_queue_delay_seconds              histogram: oldest slice's
//   wait detlogp_gather_seconds                   histogram: staging a batch's
//   rows detlogp_compute_seconds                  histogram: backend time per
//   batch detlogp_queue_rows                       gauge: rows waiting now
//   detlogp_queue_capacity_rows              gauge: rows the queue holds now
//   detlogp_device_memory_used_bytes         gauge: GPU memory in use (0 on
//   CPU) detlogp_model_rows_total{model}          rows answered, by model
//   detlogp_model_latest_version{model}      gauge: newest ready version
//   detlogp_model_ready_versions{model}      gauge: versions answering requests
//   detlogp_model_memory_bytes               gauge: bytes held by model
//   versions detlogp_projection_streams_total         projection streams
//   finished detlogp_projection_chunks_total          projection chunks written
//   detlogp_projection_write_seconds_total   stream time with a write in flight
//   detlogp_projection_compute_wait_seconds_total
//                                            stream time with nothing to write:
//                                            the next chunk not computed yet
//   detlogp_projection_launch_rows           histogram of rows per launch
//   detlogp_projection_queue_delay_seconds   histogram: oldest chunk's wait
//   detlogp_projection_run_seconds           histogram: backend time per launch
//   detlogp_projection_copy_out_seconds      histogram: copying a launch's Y
//                                            into its chunks on the host (~0
//                                            when the GPU wrote them)
//   detlogp_projection_chunk_buffers_total{source}
//                                            chunk buffers streams took: from
//                                            the cache, new (pinned on CUDA),
//                                            or the heap when that failed
//   detlogp_projection_chunk_buffers_freed_total
//                                            cached buffers given back
//   detlogp_projection_chunk_buffer_cache_bytes
//                                            gauge: bytes kept for reuse
//   detlogp_hidden_bytes_total{path}         hidden-state bytes of scheduled
//                                            requests by how they came: grpc,
//                                            system_shm, cuda_shm
//   detlogp_shared_memory_regions{kind}      gauge: registered regions,
//                                            system or cuda
//   detlogp_shared_memory_bytes{kind}        gauge: bytes those regions span
//   detlogp_shared_memory_idle_released_total
//                                            regions released after
//                                            --shared_memory_idle_s unused
//
// Names, types, label names and values and bucket bounds are those of the
// hand-written registry this replaced; dashboards depend on them. Requests,
// model rows and the histograms are counted here as they happen; the rows
// by outcome and the gauges live in the server's parts (batcher, backend,
// model manager) and are read at every scrape (MetricsSnapshot), so a
// scrape never shows a stale value.
#ifndef DETLOGP_SERVER_OBSERVABILITY_METRICS_H_
#define DETLOGP_SERVER_OBSERVABILITY_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include "absl/strings/string_view.h"

namespace detlogp::server {

// Point-in-time values the server reads from its parts at scrape time.
struct MetricsSnapshot {
  int64_t rows_computed = 0;
  int64_t rows_failed = 0;
  int64_t rows_expired = 0;
  int64_t rows_cancelled = 0;
  int64_t rows_rejected = 0;
  int64_t queue_rows = 0;
  int64_t queue_capacity_rows = 0;
  int64_t device_memory_used_bytes = 0;
  struct Model {
    std::string name;
    int64_t latest_version = 0;
    int64_t ready_versions = 0;
  };
  std::vector<Model> models;
  int64_t model_memory_bytes = 0;
  // The projection's chunk buffers (HostBufferPool::Stats).
  struct ChunkBuffers {
    int64_t cached = 0;
    int64_t allocated = 0;
    int64_t heap = 0;
    int64_t freed = 0;
    int64_t cache_bytes = 0;
  };
  ChunkBuffers chunk_buffers;
  // Registered shared-memory regions (SharedMemoryRegistry::Totals).
  struct SharedMemory {
    int64_t system_regions = 0;
    int64_t system_bytes = 0;
    int64_t cuda_regions = 0;
    int64_t cuda_bytes = 0;
    int64_t idle_released = 0;
  };
  SharedMemory shared_memory;
};

// Thread-safe: calls, batches and scrapes may come from any thread.
class ServerMetrics {
 public:
  ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  void CountRequest(absl::string_view method, int grpc_code);
  void CountModelRows(absl::string_view model, int64_t rows);
  // A scheduled request's hidden bytes and how they came ("grpc",
  // "system_shm", "cuda_shm").
  void CountHiddenBytes(absl::string_view path, int64_t bytes);
  // Model upload bytes as received on the wire, by sender ("pusher",
  // "peer").
  void CountModelBytesReceived(absl::string_view from, int64_t bytes);
  void ObserveBatch(int64_t rows, int64_t requests, double queue_delay_seconds,
                    double gather_seconds, double compute_seconds);
  // Where a projection stream's time went, once per stream that got past
  // validation; and one projection launch. Together they say whether a slow
  // stream waited on the transport or on the GPU.
  void ObserveProjectionStream(int64_t chunks, double write_seconds,
                               double compute_wait_seconds);
  void ObserveProjectionLaunch(int64_t rows, double queue_delay_seconds,
                               double run_seconds, double copy_out_seconds);

  // Every family, in the order of the list above, with the counted values
  // and those of `snapshot`. A family without samples yet (no call
  // finished) is still listed, with its type.
  std::vector<prometheus::MetricFamily> Collect(
      const MetricsSnapshot& snapshot) const;
  // Collect(snapshot) in the Prometheus text exposition format (0.0.4).
  std::string Render(const MetricsSnapshot& snapshot) const;

 private:
  // Owns the families below.
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& model_rows_;
  prometheus::Family<prometheus::Histogram>& batch_rows_;
  prometheus::Family<prometheus::Histogram>& batch_requests_;
  prometheus::Family<prometheus::Histogram>& queue_delay_seconds_;
  prometheus::Family<prometheus::Histogram>& gather_seconds_;
  prometheus::Family<prometheus::Histogram>& compute_seconds_;
  prometheus::Histogram& batch_rows_histogram_;
  prometheus::Histogram& batch_requests_histogram_;
  prometheus::Histogram& queue_delay_seconds_histogram_;
  prometheus::Histogram& gather_seconds_histogram_;
  prometheus::Histogram& compute_seconds_histogram_;
  prometheus::Family<prometheus::Counter>& projection_streams_;
  prometheus::Family<prometheus::Counter>& projection_chunks_;
  prometheus::Family<prometheus::Counter>& projection_write_seconds_;
  prometheus::Family<prometheus::Counter>& projection_compute_wait_seconds_;
  prometheus::Family<prometheus::Histogram>& projection_launch_rows_;
  prometheus::Family<prometheus::Histogram>& projection_queue_delay_seconds_;
  prometheus::Family<prometheus::Histogram>& projection_run_seconds_;
  prometheus::Family<prometheus::Histogram>& projection_copy_out_seconds_;
  prometheus::Counter& projection_streams_counter_;
  prometheus::Counter& projection_chunks_counter_;
  prometheus::Counter& projection_write_seconds_counter_;
  prometheus::Counter& projection_compute_wait_seconds_counter_;
  prometheus::Histogram& projection_launch_rows_histogram_;
  prometheus::Histogram& projection_queue_delay_seconds_histogram_;
  prometheus::Histogram& projection_run_seconds_histogram_;
  prometheus::Histogram& projection_copy_out_seconds_histogram_;
  prometheus::Family<prometheus::Counter>& hidden_bytes_;
  prometheus::Family<prometheus::Counter>& model_bytes_received_;
};

// Canonical upper-case name of a gRPC status code ("OK", "INVALID_ARGUMENT").
const char* GrpcCodeName(int code);

// Upper bounds of the histograms' buckets: first, 2 first, 4 first, ...
// (`count` bounds; +Inf is implied).
std::vector<double> PowersOfTwoBounds(double first, int count);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_OBSERVABILITY_METRICS_H_
