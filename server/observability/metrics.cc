#include "server/observability/metrics.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include <prometheus/client_metric.h>
#include <prometheus/metric_type.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/str_cat.h"

namespace detlogp::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

constexpr char kRequestsHelp[] = "Calls finished, by method and gRPC code.";
constexpr char kRowsHelp[] =
    "Rows by outcome; expired and cancelled rows were never computed.";
constexpr char kModelRowsHelp[] = "Rows answered, by model.";
constexpr char kHiddenBytesHelp[] =
    "Hidden-state bytes of scheduled requests, by how they came: in the gRPC "
    "message, or named in a system or CUDA shared-memory region.";
constexpr const char* kHiddenPaths[] = {"grpc", "system_shm", "cuda_shm"};
constexpr char kModelBytesReceivedHelp[] =
    "Bytes of model uploads received, as they came on the wire (a delta's "
    "compressed bytes), by sender: pusher (a client's UploadModel) or peer "
    "(a replica forwarding).";
constexpr const char* kModelByteSenders[] = {"pusher", "peer"};
constexpr char kProjectionStreamsHelp[] = "Projection streams finished.";
constexpr char kProjectionChunksHelp[] = "Projection chunks written.";
constexpr char kProjectionWriteHelp[] =
    "Projection stream time with a write in flight, summed over streams.";
constexpr char kProjectionComputeWaitHelp[] =
    "Projection stream time with nothing to write because the next chunk was "
    "not computed yet, summed over streams.";

MetricFamily EmptyFamily(std::string name, std::string help, MetricType type) {
  MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = type;
  return family;
}

// A counter or gauge sample with labels in the given order.
ClientMetric Sample(MetricType type, double value,
                    std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric metric;
  metric.label = std::move(labels);
  if (type == MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return metric;
}

MetricFamily OneSampleFamily(std::string name, std::string help,
                             MetricType type, double value) {
  MetricFamily family = EmptyFamily(std::move(name), std::move(help), type);
  family.metric.push_back(Sample(type, value));
  return family;
}

// The family's samples, or an empty family of that name and type when it
// has none yet (prometheus-cpp lists a family only once it has samples).
template <typename T>
MetricFamily CollectFamily(const prometheus::Family<T>& family,
                           const char* help, MetricType type) {
  std::vector<MetricFamily> collected = family.Collect();
  if (collected.empty()) return EmptyFamily(family.GetName(), help, type);
  return std::move(collected.front());
}

// prometheus-cpp keeps labels sorted by name; the series keep the label
// order they always had (`names` first, in that order), and samples are
// sorted by label values so that every scrape lists them alike.
void OrderLabels(const std::vector<std::string>& names, MetricFamily* family) {
  auto rank = [&names](const ClientMetric::Label& label) {
    return std::find(names.begin(), names.end(), label.name) - names.begin();
  };
  for (ClientMetric& metric : family->metric) {
    std::stable_sort(
        metric.label.begin(), metric.label.end(),
        [&rank](const ClientMetric::Label& a, const ClientMetric::Label& b) {
          return rank(a) < rank(b);
        });
  }
  std::sort(family->metric.begin(), family->metric.end(),
            [](const ClientMetric& a, const ClientMetric& b) {
              return a.label < b.label;
            });
}

prometheus::Family<prometheus::Counter>& AddCounter(
    prometheus::Registry& registry, const char* name, const char* help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry);
}

prometheus::Family<prometheus::Histogram>& AddHistogram(
    prometheus::Registry& registry, const char* name, const char* help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry);
}

}  // namespace

const char* GrpcCodeName(int code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN";
}

std::vector<double> PowersOfTwoBounds(double first, int count) {
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(first * (1 << i));
  return bounds;
}

ServerMetrics::ServerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(
          AddCounter(*registry_, "detlogp_requests_total", kRequestsHelp)),
      model_rows_(
          AddCounter(*registry_, "detlogp_model_rows_total", kModelRowsHelp)),
      batch_rows_(
          AddHistogram(*registry_, "detlogp_batch_rows", "Rows per batch.")),
      batch_requests_(AddHistogram(*registry_, "detlogp_batch_requests",
                                   "Request slices per batch.")),
      queue_delay_seconds_(AddHistogram(
          *registry_, "detlogp_queue_delay_seconds",
          "Time the oldest slice of a batch waited in the queue.")),
      gather_seconds_(AddHistogram(*registry_, "detlogp_gather_seconds",
                                   "Time staging a batch's rows.")),
      compute_seconds_(AddHistogram(*registry_, "detlogp_compute_seconds",
                                    "Backend time per batch.")),
      batch_rows_histogram_(batch_rows_.Add({}, PowersOfTwoBounds(1, 15))),
      batch_requests_histogram_(
          batch_requests_.Add({}, PowersOfTwoBounds(1, 12))),
      queue_delay_seconds_histogram_(
          queue_delay_seconds_.Add({}, PowersOfTwoBounds(1e-5, 18))),
      gather_seconds_histogram_(
          gather_seconds_.Add({}, PowersOfTwoBounds(1e-6, 18))),
      compute_seconds_histogram_(
          compute_seconds_.Add({}, PowersOfTwoBounds(1e-5, 18))),
      projection_streams_(AddCounter(*registry_,
                                     "detlogp_projection_streams_total",
                                     kProjectionStreamsHelp)),
      projection_chunks_(AddCounter(*registry_,
                                    "detlogp_projection_chunks_total",
                                    kProjectionChunksHelp)),
      projection_write_seconds_(
          AddCounter(*registry_, "detlogp_projection_write_seconds_total",
                     kProjectionWriteHelp)),
      projection_compute_wait_seconds_(AddCounter(
          *registry_, "detlogp_projection_compute_wait_seconds_total",
          kProjectionComputeWaitHelp)),
      projection_launch_rows_(AddHistogram(*registry_,
                                           "detlogp_projection_launch_rows",
                                           "Rows per projection launch.")),
      projection_queue_delay_seconds_(AddHistogram(
          *registry_, "detlogp_projection_queue_delay_seconds",
          "Time the oldest chunk of a projection launch waited in the queue.")),
      projection_run_seconds_(
          AddHistogram(*registry_, "detlogp_projection_run_seconds",
                       "Backend time per projection launch.")),
      projection_copy_out_seconds_(AddHistogram(
          *registry_, "detlogp_projection_copy_out_seconds",
          "Time copying a projection launch's output into its chunks.")),
      projection_streams_counter_(projection_streams_.Add({})),
      projection_chunks_counter_(projection_chunks_.Add({})),
      projection_write_seconds_counter_(projection_write_seconds_.Add({})),
      projection_compute_wait_seconds_counter_(
          projection_compute_wait_seconds_.Add({})),
      projection_launch_rows_histogram_(
          projection_launch_rows_.Add({}, PowersOfTwoBounds(1, 13))),
      projection_queue_delay_seconds_histogram_(
          projection_queue_delay_seconds_.Add({}, PowersOfTwoBounds(1e-5, 18))),
      projection_run_seconds_histogram_(
          projection_run_seconds_.Add({}, PowersOfTwoBounds(1e-5, 18))),
      projection_copy_out_seconds_histogram_(
          projection_copy_out_seconds_.Add({}, PowersOfTwoBounds(1e-5, 18))),
      hidden_bytes_(AddCounter(*registry_, "detlogp_hidden_bytes_total",
                               kHiddenBytesHelp)),
      model_bytes_received_(AddCounter(*registry_,
                                       "detlogp_model_bytes_received_total",
                                       kModelBytesReceivedHelp)) {
  // Every path and sender is listed from the start, at 0.
  for (const char* path : kHiddenPaths) hidden_bytes_.Add({{"path", path}});
  for (const char* from : kModelByteSenders) {
    model_bytes_received_.Add({{"from", from}});
  }
}

void ServerMetrics::CountModelBytesReceived(absl::string_view from,
                                            int64_t bytes) {
  model_bytes_received_.Add({{"from", std::string(from)}})
      .Increment(static_cast<double>(bytes));
}

void ServerMetrics::CountHiddenBytes(absl::string_view path, int64_t bytes) {
  hidden_bytes_.Add({{"path", std::string(path)}})
      .Increment(static_cast<double>(bytes));
}

void ServerMetrics::CountRequest(absl::string_view method, int grpc_code) {
  requests_
      .Add({{"method", std::string(method)}, {"code", GrpcCodeName(grpc_code)}})
      .Increment();
}

void ServerMetrics::CountModelRows(absl::string_view model, int64_t rows) {
  model_rows_.Add({{"model", std::string(model)}})
      .Increment(static_cast<double>(rows));
}

void ServerMetrics::ObserveBatch(int64_t rows, int64_t requests,
                                 double queue_delay_seconds,
                                 double gather_seconds,
                                 double compute_seconds) {
  batch_rows_histogram_.Observe(static_cast<double>(rows));
  batch_requests_histogram_.Observe(static_cast<double>(requests));
  queue_delay_seconds_histogram_.Observe(queue_delay_seconds);
  gather_seconds_histogram_.Observe(gather_seconds);
  compute_seconds_histogram_.Observe(compute_seconds);
}

void ServerMetrics::ObserveProjectionStream(int64_t chunks,
                                            double write_seconds,
                                            double compute_wait_seconds) {
  projection_streams_counter_.Increment();
  projection_chunks_counter_.Increment(static_cast<double>(chunks));
  projection_write_seconds_counter_.Increment(write_seconds);
  projection_compute_wait_seconds_counter_.Increment(compute_wait_seconds);
}

void ServerMetrics::ObserveProjectionLaunch(int64_t rows,
                                            double queue_delay_seconds,
                                            double run_seconds,
                                            double copy_out_seconds) {
  projection_launch_rows_histogram_.Observe(static_cast<double>(rows));
  projection_queue_delay_seconds_histogram_.Observe(queue_delay_seconds);
  projection_run_seconds_histogram_.Observe(run_seconds);
  projection_copy_out_seconds_histogram_.Observe(copy_out_seconds);
}

std::vector<MetricFamily> ServerMetrics::Collect(
    const MetricsSnapshot& snapshot) const {
  std::vector<MetricFamily> families;
  families.push_back(
      CollectFamily(requests_, kRequestsHelp, MetricType::Counter));
  OrderLabels({"method", "code"}, &families.back());

  MetricFamily rows =
      EmptyFamily("detlogp_rows_total", kRowsHelp, MetricType::Counter);
  for (const auto& [outcome, value] :
       {std::pair{"computed", snapshot.rows_computed},
        {"failed", snapshot.rows_failed},
        {"expired", snapshot.rows_expired},
        {"cancelled", snapshot.rows_cancelled},
        {"rejected", snapshot.rows_rejected}}) {
    rows.metric.push_back(Sample(MetricType::Counter,
                                 static_cast<double>(value),
                                 {{"outcome", outcome}}));
  }
  families.push_back(std::move(rows));
  // Flat aliases, handy for alerts and scripts.
  for (const auto& [outcome, value] :
       {std::pair{"computed", snapshot.rows_computed},
        {"expired", snapshot.rows_expired},
        {"cancelled", snapshot.rows_cancelled},
        {"rejected", snapshot.rows_rejected}}) {
    families.push_back(OneSampleFamily(
        absl::StrCat("detlogp_rows_", outcome, "_total"),
        absl::StrCat("Rows ", outcome, " (detlogp_rows_total{outcome=\"",
                     outcome, "\"})."),
        MetricType::Counter, static_cast<double>(value)));
  }

  for (const prometheus::Family<prometheus::Histogram>* histogram :
       {&batch_rows_, &batch_requests_, &queue_delay_seconds_, &gather_seconds_,
        &compute_seconds_}) {
    families.push_back(CollectFamily(*histogram, "", MetricType::Histogram));
  }

  families.push_back(OneSampleFamily(
      "detlogp_queue_rows", "Rows waiting in the queue now.", MetricType::Gauge,
      static_cast<double>(snapshot.queue_rows)));
  families.push_back(OneSampleFamily(
      "detlogp_queue_capacity_rows",
      "Rows the queue holds at most now (ModelInfo.max_queue_rows).",
      MetricType::Gauge, static_cast<double>(snapshot.queue_capacity_rows)));
  families.push_back(
      OneSampleFamily("detlogp_device_memory_used_bytes",
                      "GPU memory in use (0 on the CPU).", MetricType::Gauge,
                      static_cast<double>(snapshot.device_memory_used_bytes)));

  families.push_back(
      CollectFamily(model_rows_, kModelRowsHelp, MetricType::Counter));
  OrderLabels({"model"}, &families.back());
  MetricFamily latest =
      EmptyFamily("detlogp_model_latest_version",
                  "Newest ready version, by model.", MetricType::Gauge);
  MetricFamily ready =
      EmptyFamily("detlogp_model_ready_versions",
                  "Versions answering requests, by model.", MetricType::Gauge);
  for (const MetricsSnapshot::Model& model : snapshot.models) {
    latest.metric.push_back(Sample(MetricType::Gauge,
                                   static_cast<double>(model.latest_version),
                                   {{"model", model.name}}));
    ready.metric.push_back(Sample(MetricType::Gauge,
                                  static_cast<double>(model.ready_versions),
                                  {{"model", model.name}}));
  }
  families.push_back(std::move(latest));
  families.push_back(std::move(ready));
  families.push_back(OneSampleFamily(
      "detlogp_model_memory_bytes", "Bytes held by model versions.",
      MetricType::Gauge, static_cast<double>(snapshot.model_memory_bytes)));

  for (const auto& [family, help] :
       {std::pair{&projection_streams_, kProjectionStreamsHelp},
        {&projection_chunks_, kProjectionChunksHelp},
        {&projection_write_seconds_, kProjectionWriteHelp},
        {&projection_compute_wait_seconds_, kProjectionComputeWaitHelp}}) {
    families.push_back(CollectFamily(*family, help, MetricType::Counter));
  }
  for (const prometheus::Family<prometheus::Histogram>* histogram :
       {&projection_launch_rows_, &projection_queue_delay_seconds_,
        &projection_run_seconds_, &projection_copy_out_seconds_}) {
    families.push_back(CollectFamily(*histogram, "", MetricType::Histogram));
  }

  const MetricsSnapshot::ChunkBuffers& buffers = snapshot.chunk_buffers;
  MetricFamily taken = EmptyFamily(
      "detlogp_projection_chunk_buffers_total",
      "Chunk buffers projection streams took: carved from memory the pool "
      "already held (cache), from a block it had to allocate (new; pinned on "
      "CUDA), or the heap when that could not be had.",
      MetricType::Counter);
  for (const auto& [source, value] : {std::pair{"cache", buffers.cached},
                                      {"new", buffers.allocated},
                                      {"heap", buffers.heap}}) {
    taken.metric.push_back(Sample(
        MetricType::Counter, static_cast<double>(value), {{"source", source}}));
  }
  families.push_back(std::move(taken));
  families.push_back(OneSampleFamily(
      "detlogp_projection_chunk_buffers_freed_total",
      "Blocks of chunk-buffer memory given back to the system to keep idle "
      "bytes under --projection_chunk_cache_mb (idle longest first).",
      MetricType::Counter, static_cast<double>(buffers.freed)));
  families.push_back(OneSampleFamily(
      "detlogp_projection_chunk_buffer_cache_bytes",
      "Bytes of chunk-buffer memory held idle for reuse now.",
      MetricType::Gauge, static_cast<double>(buffers.cache_bytes)));

  families.push_back(
      CollectFamily(hidden_bytes_, kHiddenBytesHelp, MetricType::Counter));
  OrderLabels({"path"}, &families.back());
  families.push_back(CollectFamily(
      model_bytes_received_, kModelBytesReceivedHelp, MetricType::Counter));
  const MetricsSnapshot::SharedMemory& shm = snapshot.shared_memory;
  MetricFamily regions =
      EmptyFamily("detlogp_shared_memory_regions",
                  "Shared-memory regions registered now.", MetricType::Gauge);
  MetricFamily region_bytes = EmptyFamily(
      "detlogp_shared_memory_bytes",
      "Bytes the registered shared-memory regions span.", MetricType::Gauge);
  for (const auto& [kind, count, bytes] :
       {std::tuple{"cuda", shm.cuda_regions, shm.cuda_bytes},
        {"system", shm.system_regions, shm.system_bytes}}) {
    regions.metric.push_back(Sample(
        MetricType::Gauge, static_cast<double>(count), {{"kind", kind}}));
    region_bytes.metric.push_back(Sample(
        MetricType::Gauge, static_cast<double>(bytes), {{"kind", kind}}));
  }
  families.push_back(std::move(regions));
  families.push_back(std::move(region_bytes));
  families.push_back(OneSampleFamily(
      "detlogp_shared_memory_idle_released_total",
      "Shared-memory regions released after --shared_memory_idle_s unused.",
      MetricType::Counter, static_cast<double>(shm.idle_released)));
  return families;
}

std::string ServerMetrics::Render(const MetricsSnapshot& snapshot) const {
  return prometheus::TextSerializer().Serialize(Collect(snapshot));
}

}  // namespace detlogp::server
