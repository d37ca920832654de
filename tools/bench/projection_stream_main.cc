// Projection streaming without the compute: the real ProjectionService and
// ProjectionScheduler over loopback, on a backend whose Run returns at once,
// so what is measured is the transport path (the service's buffers and
// writes, gRPC, the reader). Reports GB/s of Y per rows_per_chunk for one
// stream and for several at once, and where each server stream's time went.
//
//   bazel build //tools/bench:projection_stream
//   bazel-bin/tools/bench/projection_stream --reader=client --rows=364608
//     --chunks=256,512,1024,2048 --streams=4
//     --concurrent_chunks=256,512,1024,2048
//
// Each setting runs --repeats times (a fresh connection each); the median
// run's GB/s is reported with the process's CPU seconds and minor page
// faults per GB moved (client and server share the process) and the
// server's StreamTimings. --heap_retain_mb and --malloc_arenas are what
// detlogp_cli project --project_malloc_tuning applies
// (--project_heap_retain_mb, --project_malloc_arenas;
// client/heap_retention.h); 0 gives glibc's default for a before/after.
//
// --reader=proto parses every chunk into a ProjectResponse (what
// LogpClient::Project did before the raw read path); --reader=raw keeps
// gRPC's bytes and checks nothing (the floor); --reader=client is
// LogpClient::ProjectChunks, what detlogp_cli project and Project use now
// (header walked from the wire bytes, every chunk checked, y.data left in
// gRPC's slices), with --client_copy_y copying each chunk once into a
// caller's buffer as Project does (a reused 64 MiB one here, so that a 7.8 GB
// Y need not fit in memory). --client_streams=N spreads each projection over
// N Project calls on N connections (ProjectOptions::streams).
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/sync_stream.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/heap_retention.h"
#include "client/process_usage.h"
#include "client/logp_client.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "kernels/projection.h"
#include "server/backends/projection_backend.h"
#include "server/batching/projection_scheduler.h"
#include "server/transport/projection_service.h"

ABSL_FLAG(int64_t, rows, 364608, "Rows of X per stream (one H3 video).");
ABSL_FLAG(std::string, chunks, "256,512,1024,2048", "rows_per_chunk values.");
ABSL_FLAG(int, streams, 4, "Streams at once for the concurrent run (0: skip).");
ABSL_FLAG(std::string, concurrent_chunks, "512",
          "rows_per_chunk values of the concurrent runs.");
ABSL_FLAG(int, repeats, 3, "Runs per setting; the median is reported.");
ABSL_FLAG(int64_t, heap_retain_mb, 256,
          "client::RetainFreedHeapMemory in MiB, as detlogp_cli's "
          "--project_heap_retain_mb (0: glibc's default: freed receive "
          "buffers go back to the OS).");
ABSL_FLAG(int, malloc_arenas, 1,
          "client::LimitMallocArenas, as detlogp_cli's "
          "--project_malloc_arenas (0: glibc's default).");
ABSL_FLAG(std::string, reader, "proto",
          "proto, raw or client (see the file comment).");
ABSL_FLAG(
    int, client_streams, 1,
    "--reader=client: ProjectOptions::streams, the Project calls (each on "
    "its own connection) one projection is spread over.");
ABSL_FLAG(bool, client_copy_y, false,
          "--reader=client: copy each chunk's y once into a caller's buffer.");
ABSL_FLAG(int64_t, max_stream_buffer_mb, -1,
          "ProjectionServiceImpl::Options::max_stream_buffer_bytes in MiB "
          "(-1: the default).");
ABSL_FLAG(std::string, client_args, "",
          "Integer channel arguments for the client, name=value,...");
ABSL_FLAG(std::string, server_args, "",
          "Integer channel arguments for the server, name=value,...");
ABSL_FLAG(std::string, unix_socket, "",
          "Listen and connect on this Unix-domain socket path instead of "
          "loopback TCP.");
ABSL_FLAG(int, scheduler_threads, 2,
          "ProjectionScheduler::Options::num_threads.");

namespace detlogp {
namespace {

using kernels::kProjectionInDim;
using kernels::kProjectionOutDim;

// Run returns once it has copied a fixed pattern (written once) into the
// chunks: the host copy-out of the CPU backend and of the CUDA backend
// before its chunks were pinned.
class InstantProjectionBackend final : public server::ProjectionBackend {
 public:
  InstantProjectionBackend() { description_.name = "instant"; }
  const server::BackendDescription& description() const override {
    return description_;
  }
  absl::StatusOr<std::unique_ptr<server::ProjectionExecutor>> NewExecutor(
      int64_t max_rows) override {
    return std::unique_ptr<server::ProjectionExecutor>(new Executor(max_rows));
  }

 private:
  class Executor final : public server::ProjectionExecutor {
   public:
    explicit Executor(int64_t rows)
        : rows_(rows),
          x_(rows * kProjectionInDim),
          y_(rows * kProjectionOutDim) {
      for (size_t i = 0; i < y_.size(); ++i)
        y_[i] = static_cast<float>(i % 977);
    }
    server::ProjectionStaging staging() override { return {rows_, x_.data()}; }
    absl::Status Run(int64_t, absl::Span<const server::YDestination> outputs,
                     server::ProjectionRunStats* stats) override {
      const double copy_out = server::CopyOutOfStaging(y_.data(), outputs);
      if (stats != nullptr) stats->copy_out_seconds = copy_out;
      return absl::OkStatus();
    }

   private:
    int64_t rows_;
    std::vector<float> x_, y_;
  };
  server::BackendDescription description_;
};

struct StreamResult {
  double seconds = 0;
  int64_t bytes = 0;
  bool ok = false;
  std::string error;
};

enum class Reader { kProto, kRaw, kClient };

// LogpClient::ProjectChunks on a connection of its own (own_connection).
StreamResult RunClientStream(const std::string& target,
                             const std::vector<float>& x, int64_t rows,
                             int64_t rows_per_chunk) {
  StreamResult result;
  client::LogpClient::Options options;
  options.target = target;
  options.own_connection = true;
  options.max_message_bytes = -1;
  options.timeout = absl::Minutes(10);
  auto client = client::LogpClient::Create(options);
  if (!client.ok()) {
    result.error = client.status().ToString();
    return result;
  }
  client::LogpClient::ProjectOptions project;
  project.rows_per_chunk = rows_per_chunk;
  project.streams = absl::GetFlag(FLAGS_client_streams);
  std::vector<float> y;
  const int64_t row_floats = kProjectionOutDim;
  if (absl::GetFlag(FLAGS_client_copy_y)) y.resize((64 << 20) / sizeof(float));
  const int64_t ring_rows = static_cast<int64_t>(y.size()) / row_floats;
  const absl::Time start = absl::Now();
  auto done = (*client)->ProjectChunks(
      x, rows, project, [&](client::ProjectChunk& chunk) {
        result.bytes += chunk.y_data_bytes;
        if (!y.empty()) {
          const int64_t chunk_rows = chunk.y_shape[0];
          const int64_t at = chunk.row_offset % ring_rows;
          chunk.CopyYTo(y.data() +
                        (at + chunk_rows <= ring_rows ? at : 0) * row_floats);
        }
      });
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  result.ok = done.ok();
  if (!done.ok()) result.error = done.status().ToString();
  return result;
}

StreamResult RunStream(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& request_bytes, int64_t rows,
                       int64_t rows_per_chunk, bool raw) {
  StreamResult result;
  grpc::ClientContext context;
  const absl::Time start = absl::Now();
  int64_t next_row = 0;
  if (raw) {
    grpc::Slice slice(request_bytes);
    grpc::ByteBuffer request(&slice, 1);
    const grpc::internal::RpcMethod method(
        "/detlogp.v1.ProjectionService/Project",
        grpc::internal::RpcMethod::SERVER_STREAMING, channel);
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
            channel.get(), method, &context, request));
    grpc::ByteBuffer chunk;
    while (reader->Read(&chunk)) {
      result.bytes += static_cast<int64_t>(chunk.Length());
      next_row += std::min(rows_per_chunk, rows - next_row);
    }
    const grpc::Status status = reader->Finish();
    result.ok = status.ok();
    result.error = status.error_message();
  } else {
    v1::ProjectRequest request;
    request.ParseFromString(request_bytes);
    auto stub = v1::ProjectionService::NewStub(channel);
    auto reader = stub->Project(&context, request);
    v1::ProjectResponse chunk;
    while (reader->Read(&chunk)) {
      if (chunk.row_offset() != next_row) {
        result.error = "out of order";
        context.TryCancel();
        break;
      }
      next_row += chunk.y().shape(0);
      result.bytes += static_cast<int64_t>(chunk.y().data().size());
    }
    const grpc::Status status = reader->Finish();
    result.ok = status.ok() && result.error.empty();
    if (!status.ok()) result.error = status.error_message();
  }
  if (next_row != rows && result.ok) {
    result.ok = false;
    result.error = absl::StrCat("ended at row ", next_row);
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

// Comma-separated positive rows_per_chunk values; exits on a bad one.
std::vector<int64_t> ChunkList(const std::string& text) {
  std::vector<int64_t> values;
  for (absl::string_view s : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) {
      std::fprintf(stderr, "bad rows_per_chunk list: %s\n", text.c_str());
      std::exit(2);
    }
    values.push_back(v);
  }
  return values;
}

// Wall time, CPU time and minor page faults of the whole process (server
// and client share it): faults per GB say how many received bytes landed
// on fresh pages.
struct ProcessCounters {
  double seconds = 0;
  client::ProcessUsage usage;

  static ProcessCounters Now() {
    return {absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()),
            client::ProcessUsage::Now()};
  }
  ProcessCounters operator-(const ProcessCounters& o) const {
    return {seconds - o.seconds, usage - o.usage};
  }
};

struct RunStats {
  double gb_per_s = 0;
  double cpu_s_per_gb = 0;
  double page_faults_per_gb = 0;
  std::string server;  // the service's StreamTimings, summed over streams
};

// "1 stream(s), rows_per_chunk 2048: median 1.52 GB/s (1.41 1.52 1.60), ..."
// with the median run's CPU, faults and server timings.
std::string Summary(int streams, int64_t chunk, std::vector<RunStats> runs) {
  std::string all;
  for (const RunStats& r : runs)
    absl::StrAppend(&all, all.empty() ? "" : " ",
                    absl::StrFormat("%.2f", r.gb_per_s));
  std::sort(runs.begin(), runs.end(), [](const RunStats& a, const RunStats& b) {
    return a.gb_per_s < b.gb_per_s;
  });
  const RunStats& median = runs[runs.size() / 2];
  return absl::StrFormat(
      "%d stream(s), rows_per_chunk %5d: median %.2f GB/s in total (runs %s); "
      "CPU s/GB %.2f, page faults/GB %.0f (a GB is %.0f pages)\n  %s",
      streams, chunk, median.gb_per_s, all, median.cpu_s_per_gb,
      median.page_faults_per_gb, 1e9 / 4096, median.server);
}

// name=value,... of integer channel arguments.
std::vector<std::pair<std::string, int>> IntArgs(const std::string& text) {
  std::vector<std::pair<std::string, int>> args;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, '=');
    int value = 0;
    if (!absl::SimpleAtoi(kv.second, &value)) {
      std::fprintf(stderr, "bad channel argument %s\n",
                   std::string(item).c_str());
      std::exit(2);
    }
    args.emplace_back(kv.first, value);
  }
  return args;
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& target,
                                          int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection each,
  args.SetInt("detlogp.bench.channel", index);         // as separate CLIs
  for (const auto& [name, value] : IntArgs(absl::GetFlag(FLAGS_client_args))) {
    args.SetInt(name, value);
  }
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(),
                                   args);
}

#ifndef DETLOGP_BENCH_OLD_SERVICE
// Sums of the service's per-stream timings since the last Take().
class TimingSink {
 public:
  void Add(const server::ProjectionServiceImpl::StreamTimings& t) {
    absl::MutexLock lock(&mu_);
    sum_.chunks += t.chunks;
    sum_.write_seconds += t.write_seconds;
    sum_.waited_for_compute_seconds += t.waited_for_compute_seconds;
    sum_.most_chunks_buffered =
        std::max(sum_.most_chunks_buffered, t.most_chunks_buffered);
    sum_.buffers_allocated += t.buffers_allocated;
    ++streams_;
  }
  std::string Take() {
    absl::MutexLock lock(&mu_);
    std::string line = absl::StrCat(
        "server, summed over ", streams_, " streams: chunks ", sum_.chunks,
        ", write in flight s ", absl::SixDigits(sum_.write_seconds),
        ", no write, next chunk not computed s ",
        absl::SixDigits(sum_.waited_for_compute_seconds),
        ", most chunks buffered in a stream ", sum_.most_chunks_buffered,
        ", chunk buffers allocated ", sum_.buffers_allocated);
    sum_ = {};
    streams_ = 0;
    return line;
  }

 private:
  absl::Mutex mu_;
  server::ProjectionServiceImpl::StreamTimings sum_ ABSL_GUARDED_BY(mu_);
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
};
#else
struct TimingSink {
  std::string Take() { return ""; }
};
#endif

int Main() {
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  Reader reader = Reader::kProto;
  if (absl::GetFlag(FLAGS_reader) == "raw") {
    reader = Reader::kRaw;
  } else if (absl::GetFlag(FLAGS_reader) == "client") {
    reader = Reader::kClient;
  } else if (absl::GetFlag(FLAGS_reader) != "proto") {
    std::fprintf(stderr, "bad --reader\n");
    return 2;
  }
  const bool raw = reader == Reader::kRaw;
  const std::vector<int64_t> chunk_sizes =
      ChunkList(absl::GetFlag(FLAGS_chunks));
  const std::vector<int64_t> concurrent_chunks =
      ChunkList(absl::GetFlag(FLAGS_concurrent_chunks));
  int64_t max_chunk = 1;
  for (int64_t c : chunk_sizes) max_chunk = std::max(max_chunk, c);
  for (int64_t c : concurrent_chunks) max_chunk = std::max(max_chunk, c);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  if (absl::Status s = client::RetainFreedHeapMemory(
          absl::GetFlag(FLAGS_heap_retain_mb) * (int64_t{1} << 20));
      !s.ok()) {
    std::fprintf(stderr, "--heap_retain_mb: %s\n", s.ToString().c_str());
    return 2;
  }
  if (absl::Status s =
          client::LimitMallocArenas(absl::GetFlag(FLAGS_malloc_arenas));
      !s.ok()) {
    std::fprintf(stderr, "--malloc_arenas: %s\n", s.ToString().c_str());
    return 2;
  }

  InstantProjectionBackend backend;
  server::ProjectionScheduler::Options scheduler_options;
  scheduler_options.max_launch_rows = max_chunk;
  scheduler_options.num_threads = absl::GetFlag(FLAGS_scheduler_threads);
  auto scheduler =
      *server::ProjectionScheduler::Create(scheduler_options, &backend);
  TimingSink timings;
  server::ProjectionServiceImpl::Options service_options;
  service_options.determinism_key = "bench";
#ifndef DETLOGP_BENCH_OLD_SERVICE
  if (absl::GetFlag(FLAGS_max_stream_buffer_mb) >= 0) {
    service_options.max_stream_buffer_bytes =
        absl::GetFlag(FLAGS_max_stream_buffer_mb) << 20;
  }
  service_options.on_stream_timings =
      [&](const server::ProjectionServiceImpl::StreamTimings& t) {
        timings.Add(t);
      };
#endif
  server::ProjectionServiceImpl service(service_options, scheduler.get());
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string unix_socket = absl::GetFlag(FLAGS_unix_socket);
  if (unix_socket.empty()) {
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
  } else {
    builder.AddListeningPort(absl::StrCat("unix:", unix_socket),
                             grpc::InsecureServerCredentials());
  }
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  for (const auto& [name, value] : IntArgs(absl::GetFlag(FLAGS_server_args))) {
    builder.AddChannelArgument(name, value);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  const std::string target = unix_socket.empty()
                                 ? absl::StrCat("127.0.0.1:", port)
                                 : absl::StrCat("unix:", unix_socket);

  std::vector<float> x(rows * kProjectionInDim, 0.5f);
  v1::ProjectRequest request;
  request.set_request_id("bench");
  request.mutable_x()->set_dtype(v1::DTYPE_FLOAT32);
  request.mutable_x()->add_shape(rows);
  request.mutable_x()->add_shape(kProjectionInDim);
  request.mutable_x()->set_data(x.data(), x.size() * sizeof(float));
  const double output_gb = rows * kProjectionOutDim * 4.0 / 1e9;

  std::printf(
      "rows %lld (%.2f GB of Y per stream), reader %s%s%s, heap_retain_mb "
      "%lld, "
      "median of %d runs\n",
      static_cast<long long>(rows), output_gb,
      absl::GetFlag(FLAGS_reader).c_str(),
      reader == Reader::kClient && absl::GetFlag(FLAGS_client_copy_y)
          ? " (one copy of y)"
          : "",
      reader == Reader::kClient
          ? absl::StrCat(" (", absl::GetFlag(FLAGS_client_streams),
                         " calls per projection)")
                .c_str()
          : "",
      static_cast<long long>(absl::GetFlag(FLAGS_heap_retain_mb)), repeats);
  // `streams` streams at once, each a connection of its own; GB/s in total.
  auto run_streams = [&](int streams,
                         int64_t chunk) -> absl::StatusOr<RunStats> {
    request.set_rows_per_chunk(chunk);
    const std::string bytes = request.SerializeAsString();
    std::vector<StreamResult> results(streams);
    std::vector<std::thread> threads;
    const ProcessCounters before = ProcessCounters::Now();
    for (int i = 0; i < streams; ++i) {
      threads.emplace_back([&, i] {
        results[i] =
            reader == Reader::kClient
                ? RunClientStream(target, x, rows, chunk)
                : RunStream(NewChannel(target, i), bytes, rows, chunk, raw);
      });
    }
    for (auto& t : threads) t.join();
    const ProcessCounters used = ProcessCounters::Now() - before;
    for (const StreamResult& r : results) {
      if (!r.ok) return absl::InternalError(r.error);
    }
    const double gb = streams * output_gb;
    RunStats stats;
    stats.gb_per_s = gb / used.seconds;
    stats.cpu_s_per_gb = used.usage.cpu_seconds / gb;
    stats.page_faults_per_gb =
        static_cast<double>(used.usage.minor_page_faults) / gb;
    absl::SleepFor(
        absl::Milliseconds(50));  // the streams' timings arrive in OnDone
    stats.server = timings.Take();
    return stats;
  };
  auto measure = [&](int streams, int64_t chunk) {
    std::vector<RunStats> runs;
    for (int i = 0; i < repeats; ++i) {
      absl::StatusOr<RunStats> run = run_streams(streams, chunk);
      if (!run.ok()) {
        std::printf("%d stream(s), rows_per_chunk %lld failed: %s\n", streams,
                    static_cast<long long>(chunk),
                    run.status().ToString().c_str());
        std::exit(1);
      }
      runs.push_back(*std::move(run));
    }
    std::printf("%s\n", Summary(streams, chunk, runs).c_str());
    std::fflush(stdout);
  };
  for (int64_t chunk : chunk_sizes) measure(1, chunk);
  const int streams = absl::GetFlag(FLAGS_streams);
  if (streams > 0) {
    for (int64_t chunk : concurrent_chunks) measure(streams, chunk);
  }
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  scheduler->Stop();
  return 0;
}

}  // namespace
}  // namespace detlogp

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return detlogp::Main();
}
