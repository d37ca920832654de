// The Prometheus metrics (prometheus-cpp): the names, types, label names and
// values and bucket bounds that dashboards and scripts read, unchanged from
// the hand-written registry they replaced; and /metrics served on an IPv6
// loopback --host.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/logp_client.h"
#include "client/random_rows.h"
#include "server/observability/metrics.h"
#include "tests/server_process.h"

namespace detlogp {
namespace {

using server::MetricsSnapshot;
using server::ServerMetrics;
using testing::ServerProcess;

// Every family and its type, as the hand-written registry rendered them.
const std::map<std::string, std::string>& ExpectedTypes() {
  static const auto* types = new std::map<std::string, std::string>{
      {"detlogp_requests_total", "counter"},
      {"detlogp_rows_total", "counter"},
      {"detlogp_rows_computed_total", "counter"},
      {"detlogp_rows_expired_total", "counter"},
      {"detlogp_rows_cancelled_total", "counter"},
      {"detlogp_rows_rejected_total", "counter"},
      {"detlogp_batch_rows", "histogram"},
      {"detlogp_batch_requests", "histogram"},
      {"detlogp_queue_delay_seconds", "histogram"},
      {"detlogp_gather_seconds", "histogram"},
      {"detlogp_compute_seconds", "histogram"},
      {"detlogp_queue_rows", "gauge"},
      {"detlogp_queue_capacity_rows", "gauge"},
      {"detlogp_device_memory_used_bytes", "gauge"},
      {"detlogp_model_rows_total", "counter"},
      {"detlogp_model_latest_version", "gauge"},
      {"detlogp_model_ready_versions", "gauge"},
      {"detlogp_model_memory_bytes", "gauge"},
      {"detlogp_projection_streams_total", "counter"},
      {"detlogp_projection_chunks_total", "counter"},
      {"detlogp_projection_write_seconds_total", "counter"},
      {"detlogp_projection_compute_wait_seconds_total", "counter"},
      {"detlogp_projection_launch_rows", "histogram"},
      {"detlogp_projection_queue_delay_seconds", "histogram"},
      {"detlogp_projection_run_seconds", "histogram"},
      {"detlogp_projection_copy_out_seconds", "histogram"},
      {"detlogp_projection_chunk_buffers_total", "counter"},
      {"detlogp_projection_chunk_buffers_freed_total", "counter"},
      {"detlogp_projection_chunk_buffer_cache_bytes", "gauge"},
      {"detlogp_hidden_bytes_total", "counter"},
      {"detlogp_model_bytes_received_total", "counter"},
      {"detlogp_shared_memory_regions", "gauge"},
      {"detlogp_shared_memory_bytes", "gauge"},
      {"detlogp_shared_memory_idle_released_total", "counter"},
  };
  return *types;
}

// The exposition text parsed: "# TYPE" lines, and samples by series
// (name{labels} exactly as written).
struct Exposition {
  std::map<std::string, std::string> types;
  std::map<std::string, double> samples;
};

Exposition Parse(const std::string& text) {
  Exposition parsed;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() == 2) parsed.types[parts[0]] = parts[1];
      continue;
    }
    if (absl::StartsWith(line, "#")) continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    double value = 0;
    const std::string number(line.substr(space + 1));
    if (number == "+Inf") {
      value = HUGE_VAL;
    } else if (!absl::SimpleAtod(number, &value)) {
      continue;
    }
    parsed.samples[std::string(line.substr(0, space))] = value;
  }
  return parsed;
}

// The `le` bounds of `name`'s buckets, in order, with their counts.
std::vector<std::pair<double, double>> Buckets(const std::string& text,
                                               const std::string& name) {
  std::vector<std::pair<double, double>> buckets;
  const std::string prefix = name + "_bucket{le=\"";
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&line, prefix)) continue;
    const size_t quote = line.find('"');
    const std::string bound(line.substr(0, quote));
    double le = HUGE_VAL;
    if (bound != "+Inf") {
      EXPECT_TRUE(absl::SimpleAtod(bound, &le)) << bound;
    }
    double count = -1;
    EXPECT_TRUE(absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &count));
    buckets.push_back({le, count});
  }
  return buckets;
}

// first, 2 first, ..., 2^(count-1) first, then +Inf: the bounds the
// hand-written registry used.
std::vector<double> ExpectedBounds(double first, int count) {
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(first * (1 << i));
  bounds.push_back(HUGE_VAL);
  return bounds;
}

TEST(ServerMetricsTest, NamesTypesLabelsAndBucketsAreThoseDashboardsRead) {
  ServerMetrics metrics;
  // Before any call: every family is listed with its type.
  EXPECT_EQ(Parse(metrics.Render(MetricsSnapshot())).types, ExpectedTypes());

  metrics.CountRequest("ComputeLogProbs", 0);
  metrics.CountRequest("ComputeLogProbs", 0);
  metrics.CountRequest("ComputeLogProbs", 3);
  metrics.CountRequest("GetModelInfo", 0);
  metrics.CountRequest("UploadModel", 15);
  metrics.CountRequest("ComputeLogProbs", 99);
  metrics.CountModelRows("policy", 17);
  metrics.CountModelRows("policy", 3);
  metrics.CountModelRows("reference", 1000000);
  metrics.ObserveBatch(2, 1, 0.0003, 0.00001, 0.002);
  metrics.ObserveBatch(64, 8, 0.00008, 0.0000001, 0.7);
  metrics.ObserveBatch(100000, 5000, 3, 1, 10);
  metrics.ObserveProjectionStream(713, 2.5, 0.25);
  metrics.ObserveProjectionStream(1, 0.5, 0);
  metrics.ObserveProjectionLaunch(2048, 0.001, 0.004, 0.006);
  metrics.ObserveProjectionLaunch(17, 0.00002, 0.0001, 0.00003);
  MetricsSnapshot snapshot;
  snapshot.rows_computed = 123456789;
  snapshot.rows_failed = 1;
  snapshot.rows_expired = 40;
  snapshot.rows_cancelled = 8;
  snapshot.rows_rejected = 64;
  snapshot.queue_rows = 5;
  snapshot.queue_capacity_rows = 262144;
  snapshot.device_memory_used_bytes = 81234567890;
  snapshot.model_memory_bytes = 1240000000;
  snapshot.models.push_back({"policy", 7, 2});
  snapshot.models.push_back({"reference", 1, 1});
  snapshot.chunk_buffers = {690, 24, 1, 8, 264241152};
  snapshot.shared_memory = {2, 1 << 30, 1, 3 << 20, 5};
  metrics.CountHiddenBytes("grpc", 8192);
  metrics.CountHiddenBytes("system_shm", 1 << 20);
  metrics.CountHiddenBytes("system_shm", 1 << 20);
  metrics.CountModelBytesReceived("pusher", 4 << 20);
  metrics.CountModelBytesReceived("pusher", 1000);
  const std::string text = metrics.Render(snapshot);
  const Exposition parsed = Parse(text);
  EXPECT_EQ(parsed.types, ExpectedTypes()) << text;

  const std::map<std::string, double> expected = {
      {"detlogp_requests_total{method=\"ComputeLogProbs\",code=\"OK\"}", 2},
      {"detlogp_requests_total{method=\"ComputeLogProbs\",code=\"INVALID_"
       "ARGUMENT\"}",
       1},
      {"detlogp_requests_total{method=\"ComputeLogProbs\",code=\"UNKNOWN\"}",
       1},
      {"detlogp_requests_total{method=\"GetModelInfo\",code=\"OK\"}", 1},
      {"detlogp_requests_total{method=\"UploadModel\",code=\"DATA_LOSS\"}", 1},
      {"detlogp_rows_total{outcome=\"computed\"}", 123456789},
      {"detlogp_rows_total{outcome=\"failed\"}", 1},
      {"detlogp_rows_total{outcome=\"expired\"}", 40},
      {"detlogp_rows_total{outcome=\"cancelled\"}", 8},
      {"detlogp_rows_total{outcome=\"rejected\"}", 64},
      {"detlogp_rows_computed_total", 123456789},
      {"detlogp_rows_expired_total", 40},
      {"detlogp_rows_cancelled_total", 8},
      {"detlogp_rows_rejected_total", 64},
      {"detlogp_batch_rows_count", 3},
      {"detlogp_batch_rows_sum", 100066},
      {"detlogp_batch_requests_count", 3},
      {"detlogp_batch_requests_sum", 5009},
      {"detlogp_queue_delay_seconds_count", 3},
      {"detlogp_gather_seconds_count", 3},
      {"detlogp_compute_seconds_count", 3},
      {"detlogp_queue_rows", 5},
      {"detlogp_queue_capacity_rows", 262144},
      {"detlogp_device_memory_used_bytes", 81234567890},
      {"detlogp_model_rows_total{model=\"policy\"}", 20},
      {"detlogp_model_rows_total{model=\"reference\"}", 1000000},
      {"detlogp_model_latest_version{model=\"policy\"}", 7},
      {"detlogp_model_latest_version{model=\"reference\"}", 1},
      {"detlogp_model_ready_versions{model=\"policy\"}", 2},
      {"detlogp_model_ready_versions{model=\"reference\"}", 1},
      {"detlogp_model_memory_bytes", 1240000000},
      {"detlogp_projection_streams_total", 2},
      {"detlogp_projection_chunks_total", 714},
      {"detlogp_projection_write_seconds_total", 3},
      {"detlogp_projection_compute_wait_seconds_total", 0.25},
      {"detlogp_projection_launch_rows_count", 2},
      {"detlogp_projection_launch_rows_sum", 2065},
      {"detlogp_projection_queue_delay_seconds_count", 2},
      {"detlogp_projection_run_seconds_count", 2},
      {"detlogp_projection_copy_out_seconds_count", 2},
      {"detlogp_projection_chunk_buffers_total{source=\"cache\"}", 690},
      {"detlogp_projection_chunk_buffers_total{source=\"new\"}", 24},
      {"detlogp_projection_chunk_buffers_total{source=\"heap\"}", 1},
      {"detlogp_projection_chunk_buffers_freed_total", 8},
      {"detlogp_projection_chunk_buffer_cache_bytes", 264241152},
      {"detlogp_hidden_bytes_total{path=\"grpc\"}", 8192},
      {"detlogp_hidden_bytes_total{path=\"system_shm\"}", 2 << 20},
      {"detlogp_hidden_bytes_total{path=\"cuda_shm\"}", 0},
      {"detlogp_model_bytes_received_total{from=\"pusher\"}", (4 << 20) + 1000},
      {"detlogp_model_bytes_received_total{from=\"peer\"}", 0},
      {"detlogp_shared_memory_regions{kind=\"system\"}", 2},
      {"detlogp_shared_memory_regions{kind=\"cuda\"}", 1},
      {"detlogp_shared_memory_bytes{kind=\"system\"}", 1 << 30},
      {"detlogp_shared_memory_bytes{kind=\"cuda\"}", 3 << 20},
      {"detlogp_shared_memory_idle_released_total", 5},
  };
  for (const auto& [series, value] : expected) {
    auto it = parsed.samples.find(series);
    ASSERT_NE(it, parsed.samples.end()) << series << " missing in\n" << text;
    EXPECT_EQ(it->second, value) << series;
  }
  // Integers are written as integers (scripts and the tests' parsers split
  // on the last space and read a number).
  EXPECT_TRUE(absl::StrContains(
      text, "\ndetlogp_device_memory_used_bytes 81234567890\n"));
  EXPECT_TRUE(
      absl::StrContains(text, "\ndetlogp_rows_computed_total 123456789\n"));
  EXPECT_NEAR(parsed.samples.at("detlogp_queue_delay_seconds_sum"), 3.00038,
              1e-12);
  EXPECT_NEAR(parsed.samples.at("detlogp_gather_seconds_sum"), 1.0000101,
              1e-12);
  EXPECT_NEAR(parsed.samples.at("detlogp_compute_seconds_sum"), 10.702, 1e-12);

  // Only these series: no other label sets, no other names.
  std::set<std::string> names;
  for (const auto& [series, value] : parsed.samples) {
    std::string name = series.substr(0, series.find('{'));
    for (const char* suffix : {"_bucket", "_count", "_sum"}) {
      if (parsed.types.count(name) == 0 && absl::EndsWith(name, suffix)) {
        name.resize(name.size() - strlen(suffix));
      }
    }
    EXPECT_EQ(ExpectedTypes().count(name), 1u) << series;
    if (!absl::StrContains(series, "_bucket{")) {
      EXPECT_TRUE(expected.count(series) || absl::EndsWith(series, "_sum"))
          << series;
    }
  }

  // Bucket bounds (le, +Inf last) and cumulative counts; a value on a bound
  // counts in that bucket.
  struct Histogram {
    std::string name;
    std::vector<double> bounds;
    std::vector<double> observed;
  };
  for (const Histogram& histogram :
       {Histogram{"detlogp_batch_rows", ExpectedBounds(1, 15), {2, 64, 100000}},
        Histogram{
            "detlogp_batch_requests", ExpectedBounds(1, 12), {1, 8, 5000}},
        Histogram{"detlogp_queue_delay_seconds",
                  ExpectedBounds(1e-5, 18),
                  {0.0003, 0.00008, 3}},
        Histogram{"detlogp_gather_seconds",
                  ExpectedBounds(1e-6, 18),
                  {0.00001, 0.0000001, 1}},
        Histogram{"detlogp_compute_seconds",
                  ExpectedBounds(1e-5, 18),
                  {0.002, 0.7, 10}},
        Histogram{"detlogp_projection_launch_rows",
                  ExpectedBounds(1, 13),
                  {2048, 17}},
        Histogram{"detlogp_projection_queue_delay_seconds",
                  ExpectedBounds(1e-5, 18),
                  {0.001, 0.00002}},
        Histogram{"detlogp_projection_run_seconds",
                  ExpectedBounds(1e-5, 18),
                  {0.004, 0.0001}},
        Histogram{"detlogp_projection_copy_out_seconds",
                  ExpectedBounds(1e-5, 18),
                  {0.006, 0.00003}}}) {
    const auto buckets = Buckets(text, histogram.name);
    ASSERT_EQ(buckets.size(), histogram.bounds.size()) << histogram.name;
    for (size_t i = 0; i < buckets.size(); ++i) {
      EXPECT_EQ(buckets[i].first, histogram.bounds[i])
          << histogram.name << " bucket " << i;
      double below = 0;
      for (double value : histogram.observed)
        below += value <= histogram.bounds[i];
      EXPECT_EQ(buckets[i].second, below)
          << histogram.name << " le " << histogram.bounds[i];
    }
  }
}

bool HasIpv6Loopback() {
  const int fd = socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 address{};
  address.sin6_family = AF_INET6;
  address.sin6_addr = in6addr_loopback;
  const bool ok =
      bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return ok;
}

TEST(MetricsEndpointTest, ServedOnIpv6LoopbackHost) {
  if (!HasIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback on this machine";
  auto server =
      ServerProcess::Start({"--device=cpu", "--host=::1", "--metrics_port=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->metrics_port(), 0);
  client::LogpClient::Options options;
  options.target = absl::StrCat("[::1]:", (*server)->port());
  auto client = client::LogpClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const int64_t rows = 3;
  auto answer = (*client)->Score(client::MakeLogProbRequest(
      "ipv6", v1::DTYPE_BFLOAT16, rows, 1024,
      client::RandomBf16Rows(rows, 1024, 5),
      client::RandomTargets(rows, 32000, 6), 1.0f, false));
  ASSERT_TRUE(answer.ok()) << answer.status();

  auto text = (*server)->HttpGet("/metrics", "::1");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_TRUE(absl::StartsWith(*text, "HTTP/1.1 200 OK\r\n")) << *text;
  const std::string body = text->substr(text->find("\r\n\r\n") + 4);
  const Exposition parsed = Parse(body);
  EXPECT_EQ(parsed.types, ExpectedTypes()) << body;
  // The warm-up batch (2 rows) and the call.
  EXPECT_EQ(
      parsed.samples.at(
          "detlogp_requests_total{method=\"ComputeLogProbs\",code=\"OK\"}"),
      1);
  EXPECT_EQ(parsed.samples.at("detlogp_rows_total{outcome=\"computed\"}"),
            2 + rows);
  EXPECT_EQ(parsed.samples.at("detlogp_rows_computed_total"), 2 + rows);
  EXPECT_EQ(parsed.samples.at("detlogp_model_rows_total{model=\"default\"}"),
            rows);
  EXPECT_EQ(
      parsed.samples.at("detlogp_model_latest_version{model=\"default\"}"), 1);
  EXPECT_EQ(
      parsed.samples.at("detlogp_model_ready_versions{model=\"default\"}"), 1);
  EXPECT_EQ(parsed.samples.at("detlogp_batch_rows_count"), 2);
  EXPECT_EQ(parsed.samples.at("detlogp_queue_rows"), 0);
  EXPECT_GT(parsed.samples.at("detlogp_model_memory_bytes"), 0);

  // No projection yet: the projection families are listed, with zeros.
  EXPECT_EQ(parsed.samples.at("detlogp_projection_streams_total"), 0);
  EXPECT_EQ(parsed.samples.at("detlogp_projection_launch_rows_count"), 0);

  auto missing = (*server)->HttpGet("/nope", "::1");
  ASSERT_TRUE(missing.ok());
  EXPECT_TRUE(absl::StartsWith(*missing, "HTTP/1.1 404")) << *missing;
  // Bound to --host only.
  EXPECT_FALSE((*server)->HttpGet("/metrics", "127.0.0.1").ok());
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

// Where projection streams wait, as an operator reads it: one projection of
// 300 rows in chunks of 64 is one stream, 5 chunks, launches covering the
// 300 rows, and the stream's time split into writing and waiting.
TEST(MetricsEndpointTest, ProjectionStreamsAndLaunchesAreCounted) {
  auto server = ServerProcess::Start(
      {"--device=cpu", "--cpu_threads=2", "--metrics_port=0",
       "--synthetic_hidden_size=64", "--synthetic_vocab_size=1000"});
  ASSERT_TRUE(server.ok()) << server.status();
  client::LogpClient::Options options;
  options.target = (*server)->target();
  auto client = client::LogpClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const int64_t rows = 300;
  const std::vector<float> x(rows * 96, 0.5f);
  client::LogpClient::ProjectOptions project;
  project.rows_per_chunk = 64;
  auto result = (*client)->ProjectChunks(x, rows, project);
  ASSERT_TRUE(result.ok()) << result.status();

  // The stream's timings are reported when its reactor is done, just after
  // the client has read the status: poll briefly.
  Exposition parsed;
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto text = (*server)->HttpGet("/metrics", "127.0.0.1");
    ASSERT_TRUE(text.ok()) << text.status();
    parsed = Parse(text->substr(text->find("\r\n\r\n") + 4));
    if (parsed.samples["detlogp_projection_streams_total"] == 1) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(parsed.samples["detlogp_projection_streams_total"], 1);
  EXPECT_EQ(parsed.samples["detlogp_projection_chunks_total"], 5);
  EXPECT_EQ(parsed.samples["detlogp_projection_launch_rows_sum"], rows);
  EXPECT_GE(parsed.samples["detlogp_projection_launch_rows_count"], 1);
  EXPECT_LE(parsed.samples["detlogp_projection_launch_rows_count"], 5);
  EXPECT_GT(parsed.samples["detlogp_projection_run_seconds_sum"], 0);
  EXPECT_GT(parsed.samples["detlogp_projection_write_seconds_total"], 0);
  EXPECT_GE(parsed.samples["detlogp_projection_compute_wait_seconds_total"], 0);
  // The CPU backend's chunks are plain heap buffers, one per chunk here (5
  // chunks fit in the stream's buffer), none cached.
  EXPECT_EQ(
      parsed.samples["detlogp_projection_chunk_buffers_total{source=\"new\"}"],
      5);
  EXPECT_EQ(
      parsed
          .samples["detlogp_projection_chunk_buffers_total{source=\"cache\"}"],
      0);
  EXPECT_EQ(parsed.samples["detlogp_projection_chunk_buffer_cache_bytes"], 0);
  EXPECT_EQ((*server)->Stop(SIGTERM), 0) << (*server)->Log();
}

}  // namespace
}  // namespace detlogp
