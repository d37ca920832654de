#include "server/observability/metrics.h"

#include "absl/strings/str_cat.h"

namespace detlogp::server {
namespace {

std::vector<double> PowersOfTwo(double first, int count) {
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(first * (1 << i));
  return bounds;
}

std::string FormatBound(double bound) { return absl::StrCat(bound); }

}  // namespace

const char* GrpcCodeName(int code) {
  static constexpr const char* kNames[] = {
      "OK",           "CANCELLED",        "UNKNOWN",           "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",   "ALREADY_EXISTS",    "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",  "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",        "UNAVAILABLE",       "DATA_LOSS",
      "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN";
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      counts_(upper_bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  size_t bucket = 0;
  while (bucket < upper_bounds_.size() && value > upper_bounds_[bucket]) ++bucket;
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::Render(absl::string_view name, std::string* out) const {
  absl::MutexLock lock(&mu_);
  absl::StrAppend(out, "# TYPE ", name, " histogram\n");
  int64_t cumulative = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    cumulative += counts_[i];
    absl::StrAppend(out, name, "_bucket{le=\"",
                    i < upper_bounds_.size() ? FormatBound(upper_bounds_[i]) : "+Inf",
                    "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, name, "_sum ", sum_, "\n", name, "_count ", count_, "\n");
}

ServerMetrics::ServerMetrics()
    : batch_rows_(PowersOfTwo(1, 15)),
      batch_requests_(PowersOfTwo(1, 12)),
      queue_delay_seconds_(PowersOfTwo(1e-5, 18)),
      gather_seconds_(PowersOfTwo(1e-6, 18)),
      compute_seconds_(PowersOfTwo(1e-5, 18)) {}

void ServerMetrics::CountRequest(absl::string_view method, int grpc_code) {
  absl::MutexLock lock(&mu_);
  ++requests_[{std::string(method), grpc_code}];
}

void ServerMetrics::CountModelRows(absl::string_view model, int64_t rows) {
  absl::MutexLock lock(&mu_);
  auto it = model_rows_.find(model);
  if (it == model_rows_.end()) it = model_rows_.emplace(std::string(model), 0).first;
  it->second += rows;
}

void ServerMetrics::ObserveBatch(int64_t rows, int64_t requests,
                                 double queue_delay_seconds,
                                 double gather_seconds,
                                 double compute_seconds) {
  batch_rows_.Observe(static_cast<double>(rows));
  batch_requests_.Observe(static_cast<double>(requests));
  queue_delay_seconds_.Observe(queue_delay_seconds);
  gather_seconds_.Observe(gather_seconds);
  compute_seconds_.Observe(compute_seconds);
}

std::string ServerMetrics::Render(const MetricsSnapshot& snapshot) const {
  std::string out;
  out += "# HELP detlogp_requests_total Calls finished, by method and gRPC code.\n";
  out += "# TYPE detlogp_requests_total counter\n";
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, count] : requests_) {
      absl::StrAppend(&out, "detlogp_requests_total{method=\"", key.first,
                      "\",code=\"", GrpcCodeName(key.second), "\"} ", count, "\n");
    }
  }
  out += "# HELP detlogp_rows_total Rows by outcome; expired and cancelled rows were never computed.\n";
  out += "# TYPE detlogp_rows_total counter\n";
  for (const auto& [outcome, value] :
       {std::pair{"computed", snapshot.rows_computed},
        {"failed", snapshot.rows_failed},
        {"expired", snapshot.rows_expired},
        {"cancelled", snapshot.rows_cancelled},
        {"rejected", snapshot.rows_rejected}}) {
    absl::StrAppend(&out, "detlogp_rows_total{outcome=\"", outcome, "\"} ", value, "\n");
  }
  // Flat aliases, handy for alerts and scripts.
  for (const auto& [name, value] :
       {std::pair{"detlogp_rows_computed_total", snapshot.rows_computed},
        {"detlogp_rows_expired_total", snapshot.rows_expired},
        {"detlogp_rows_cancelled_total", snapshot.rows_cancelled},
        {"detlogp_rows_rejected_total", snapshot.rows_rejected}}) {
    absl::StrAppend(&out, "# TYPE ", name, " counter\n", name, " ", value, "\n");
  }
  batch_rows_.Render("detlogp_batch_rows", &out);
  batch_requests_.Render("detlogp_batch_requests", &out);
  queue_delay_seconds_.Render("detlogp_queue_delay_seconds", &out);
  gather_seconds_.Render("detlogp_gather_seconds", &out);
  compute_seconds_.Render("detlogp_compute_seconds", &out);
  absl::StrAppend(&out, "# TYPE detlogp_queue_rows gauge\ndetlogp_queue_rows ",
                  snapshot.queue_rows, "\n");
  absl::StrAppend(&out,
                  "# TYPE detlogp_device_memory_used_bytes gauge\n"
                  "detlogp_device_memory_used_bytes ",
                  snapshot.device_memory_used_bytes, "\n");
  out += "# HELP detlogp_model_rows_total Rows answered, by model.\n";
  out += "# TYPE detlogp_model_rows_total counter\n";
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [model, rows] : model_rows_) {
      absl::StrAppend(&out, "detlogp_model_rows_total{model=\"", model, "\"} ", rows, "\n");
    }
  }
  out += "# TYPE detlogp_model_latest_version gauge\n";
  for (const auto& model : snapshot.models) {
    absl::StrAppend(&out, "detlogp_model_latest_version{model=\"", model.name, "\"} ",
                    model.latest_version, "\n");
  }
  out += "# TYPE detlogp_model_ready_versions gauge\n";
  for (const auto& model : snapshot.models) {
    absl::StrAppend(&out, "detlogp_model_ready_versions{model=\"", model.name, "\"} ",
                    model.ready_versions, "\n");
  }
  absl::StrAppend(&out, "# TYPE detlogp_model_memory_bytes gauge\ndetlogp_model_memory_bytes ",
                  snapshot.model_memory_bytes, "\n");
  return out;
}

}  // namespace detlogp::server
