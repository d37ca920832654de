// A small C++ client for detlogp's LogProbService.
//
//   auto client = LogpClient::Create({.target = "127.0.0.1:50051"});
//   auto info = (*client)->GetModelInfo("policy");
//   auto result = (*client)->Score(MakeLogProbRequest(..., "policy"));
//   // result->model_version: the version every row was computed with
//
//   // Entropy and the 5 most likely tokens of every row, beside log p(target):
//   LogProbOptions extras;
//   extras.return_entropy = true;
//   extras.top_k = 5;
//   auto more = (*client)->Score(MakeLogProbRequest(id, dtype, rows, H, data,
//                                                   targets, extras));
//   // more->entropy[r], more->top_ids[r * 5 + j], more->top_logprobs[r * 5 +
//   j]
//
// Every answer is checked against its request: one logprob per row, lse and
// entropy per row exactly when asked for, N * top_k top-k ids and log-probs;
// a response of another size is a DATA_LOSS error naming the field.
//
// Large calls: Score cuts a request larger than the server's limits
// (ModelInfo.max_request_rows and max_receive_message_bytes, asked once)
// into requests that fit, and a call of 8 MiB of rows or more into a share
// per connection (Options::connections), sends them side by side and joins
// the answers in row order; each row's bits are those it gets alone.
//
// Replicas: with Options::targets, a call's requests are spread over the
// replicas by rows outstanding at each, and a replica that dies mid-call
// has its requests sent again to another within the deadline
// (client/call_engine.h). A "dns:///name:port" target is one replica per
// address the name resolves to, followed as the name's records change.
//
// Same host: with Options::system_shared_memory, Score copies the hidden
// rows into a POSIX shared-memory region the client owns (one for each call
// made at once, registered once with every replica that accepts it, grown
// when a call needs more) and sends a reference instead of the bytes; the
// requests spread over those replicas and fail over between them.
// The server answers with the same bits.
//
// Rows already on a GPU: Score(DeviceRows) reads them where they are. With
// Options::cuda_shared_memory, bf16 rows are copied device-to-device on the
// caller's stream into a CUDA region the client owns on that GPU (its IPC
// handle registered once, grown when a call needs more) and the requests
// name it (calls at once each take a region of their own, from a pool per
// GPU); otherwise, or when the server refuses the region, the rows are
// copied to the host and sent as bytes (or through the system region):
//
//   DeviceRows rows{.data = hidden_ptr, .device = 0, .rows = N,
//                   .hidden_size = H, .stream = stream};
//   auto result = client->Score(rows, targets, LogProbOptions{});
//   // result->path: "cuda_shm", "system_shm" or "grpc"
//
// The CUDA runtime is loaded when first needed (client/cuda_runtime_loader.h):
// the library builds and runs without CUDA, and only the device path needs
// it. Regions the caller manages itself are registered with
// RegisterSystemRegion / RegisterCudaRegion and named by
// MakeLogProbRequest(..., RegionRef, ...).
//
// Model versions are managed with ModelRepositoryClient
// (client/model_repository_client.h).
//
// gRPC statuses come back as absl::Status with the server's message.
#ifndef DETLOGP_CLIENT_LOGP_CLIENT_H_
#define DETLOGP_CLIENT_LOGP_CLIENT_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/call_engine.h"
#include "client/cuda_runtime_loader.h"
#include "client/interleaved_rows.h"
#include "client/project_chunk.h"
#include "client/region_api.h"
#include "client/region_pool.h"
#include "client/request_bytes.h"
#include "client/score_result.h"
#include "client/system_shared_memory.h"
#include "client/target_resolver.h"
#include "detlogp/v1/detlogp.grpc.pb.h"

namespace detlogp::client {

// What a request asks for beyond log p(target), and what it runs on.
struct LogProbOptions {
  // Softmax temperature; 0 means 1.
  float temperature = 1.0f;
  // Also return logsumexp per row.
  bool return_lse = false;
  // Also return the entropy per row.
  bool return_entropy = false;
  // Also return the top_k most likely tokens per row (0: none). The server
  // refuses (INVALID_ARGUMENT naming top_k) a negative value, or one above
  // its --max_top_k or the vocabulary.
  int64_t top_k = 0;
  // Empty: the server's default model.
  std::string model;
  // 0: the model's latest ready version.
  int64_t model_version = 0;
  // Also return where the call's time went on the server
  // (ScoreResult::server_timing).
  bool return_timing = false;
};

// Where a request's rows lie in a registered region (Tensor.shared_memory).
struct RegionRef {
  // The name the region was registered under.
  std::string region;
  // Of the first row's first byte, from the region's start.
  int64_t offset = 0;
  // The rows' bytes; 0: rows * hidden_size * the dtype's size.
  int64_t byte_size = 0;
};

// Hidden rows in GPU memory: [rows, hidden_size] row-major, little-endian
// elements of `dtype`, written on `stream`.
struct DeviceRows {
  // Device (or managed) memory on `device`.
  const void* data = nullptr;
  // The CUDA device, as this process numbers it; the server must number its
  // GPUs alike (the same CUDA_VISIBLE_DEVICES) for a CUDA region.
  int device = 0;
  detlogp::v1::DType dtype = detlogp::v1::DTYPE_BFLOAT16;
  int64_t rows = 0;
  int64_t hidden_size = 0;
  // The cudaStream_t that wrote the rows (null: the legacy default stream);
  // the client copies them on it and waits for it.
  void* stream = nullptr;
};

// Builds a request from raw little-endian rows of `dtype`.
detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, std::string data, const std::vector<int64_t>& targets,
    const LogProbOptions& options);

// A request whose rows lie in a registered region instead of the message.
detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, const RegionRef& region,
    const std::vector<int64_t>& targets, const LogProbOptions& options);

// The same, with the former positional arguments. `model` empty means the
// server's default model; `model_version` 0 its latest version.
detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, std::string data, const std::vector<int64_t>& targets,
    float temperature, bool return_lse, std::string model = "",
    int64_t model_version = 0);

class LogpClient {
 public:
  struct Options {
    std::string target = "127.0.0.1:50051";
    // The replicas of one model, each "host:port" (or any gRPC target
    // naming one server), or "dns:///name:port". Not empty: `target` is
    // ignored, and a Score call's requests are spread over the replicas by
    // rows outstanding at each (relative to its queue); a replica that
    // fails or goes away has its requests sent again to another one within
    // the call's deadline and takes no new ones until it answers a probe
    // again. The first target also takes the control calls (GetModelInfo,
    // the region calls, ScoreStream, Project) and the calls that name a
    // region of the caller's. The client's own shared-memory regions are
    // registered with every replica that accepts them (those on this
    // host), and their rows spread and fail over like rows in messages.
    // Empty: `target` alone.
    //
    // A "dns:" target (here or in `target`) is resolved into one replica
    // per address (every A and AAAA record; a Kubernetes headless
    // Service's ready pods), re-resolved every dns_refresh_interval and
    // after a replica failed: an address that appears gets requests, one
    // that disappears drains (no new requests; those it holds finish).
    // Its control calls keep one channel to the name (round_robin).
    std::vector<std::string> targets;
    // How often "dns:" targets are resolved again (at a Score call that
    // finds it due; RefreshReplicas resolves at once).
    absl::Duration dns_refresh_interval = absl::Seconds(30);
    // Resolves "dns:" names into single-address targets (empty:
    // ResolveWithGetaddrinfo). Tests and other service discovery inject
    // their own.
    TargetResolver resolver;
    // The time dns_refresh_interval is measured on (empty: absl::Now); a
    // test hook.
    std::function<absl::Time()> clock;
    // A failed replica is probed again after this long, doubled after each
    // failed probe up to replica_max_backoff.
    absl::Duration replica_first_backoff = absl::Milliseconds(100);
    absl::Duration replica_max_backoff = absl::Seconds(5);
    // Deadline of each call from its start: a Score call's covers every
    // request it is cut into (a call may also name a sooner one).
    absl::Duration timeout = absl::Seconds(60);
    int max_message_bytes = 256 << 20;
    // Distinct channels are distinct TCP connections (local subchannel pool).
    bool own_connection = false;
    // gRPC load-balancing policy, e.g. "round_robin" with a target listing
    // several replicas ("ipv4:10.0.0.1:50051,10.0.0.2:50051"). Empty:
    // "round_robin" for a "dns:" target (a headless Service's pods, each
    // call to the next), gRPC's default (pick_first) otherwise.
    std::string load_balancing_policy;
    // More integer channel arguments by gRPC's name (keepalive, message
    // sizes, ...), set on every channel of the client after the ones above.
    std::vector<std::pair<std::string, int>> int_channel_args;
    // Score sends hidden rows through a system shared-memory region this
    // client owns when the server allows it (same host,
    // --allow_shared_memory). Each call made at once has a region of its
    // own, up to system_shared_memory_regions (kept for later calls, grown
    // when a call needs more); a call beyond waits for one until its
    // deadline (then DEADLINE_EXCEEDED). A registration the server refuses
    // while other calls hold regions (its --max_shared_memory_bytes) lowers
    // that number instead; one refused with none held turns regions off for
    // the client: the bytes then go in the messages (shared_memory_refusal()
    // says why).
    bool system_shared_memory = false;
    int system_shared_memory_regions = 4;
    // Score(DeviceRows) copies bf16 rows device-to-device into a CUDA region
    // this client owns on the rows' GPU (one per GPU, allocated and
    // registered on first use, grown when a call needs more, unregistered
    // and freed by the destructor) and names it in the requests, when the
    // server allows it (same host, --allow_shared_memory, a GPU it computes
    // on). Each call made at once through a GPU has a region of its own
    // there, up to cuda_shared_memory_regions per GPU (kept for later calls,
    // grown when a call needs more); a call beyond waits for one until its
    // deadline (then DEADLINE_EXCEEDED). A registration the server refuses
    // while other calls hold regions lowers that number; one refused with
    // none held turns CUDA regions off for the client: rows are then copied
    // to the host and go in the messages or the system region
    // (shared_memory_refusal() says why, and the result's path_refused
    // says "cuda_shm"). Other dtypes always take the host path (CUDA
    // regions hold bf16).
    bool cuda_shared_memory = false;
    int cuda_shared_memory_regions = 4;
    // Where the CUDA runtime is looked for (Score(DeviceRows) only).
    CudaRuntime::Options cuda_runtime;
    // Cut calls larger than the server's limits into requests that fit.
    bool split_large_calls = true;
    // Rows per request when cutting; 0: the server's limits (GetModelInfo,
    // asked once when a call is large enough to need them).
    int64_t max_request_rows = 0;
    // Rows a replica's queue holds until its ModelInfo has answered (asked
    // once per replica, in the background, by the first call sent to it):
    // the client keeps its outstanding rows at each replica within that
    // replica's max_queue_rows. Conservative: a server's queue is bounded
    // in time (--max_queue_work_ms) and holds far more on a GPU.
    int64_t assumed_queue_rows = 65536;
    // Connections a call's rows are spread over when they travel in the
    // messages: the call is cut so that each carries a share (requests of at
    // least 1 MiB), sent side by side, each on a TCP connection of its own.
    // 0: 8 for calls of 8 MiB of rows or more, else 1. Rows in a
    // shared-memory region are not spread.
    int connections = 0;
    // Hidden bytes per request of a spread call at most: a larger call is
    // cut into more requests than connections, so that receiving one
    // overlaps the server's work on another (one huge message per
    // connection leaves the GPU idle while it arrives).
    int64_t spread_request_bytes = int64_t{8} << 20;
    // Requests of one spread call outstanding on each connection at once.
    int spread_requests_in_flight = 2;
    // Hidden bytes per piece, at least, of a call the client writes into
    // its system region: the call is written piece by piece (at most 8
    // pieces), each just before its request is sent, so that the server
    // starts on the first while the rest are written. Smaller pieces start
    // the server sooner; larger ones make fewer, larger batches.
    int64_t region_piece_bytes = int64_t{4} << 20;
    // Threads that write requests' bytes into gRPC's buffers, shared by the
    // client's calls (a call's copies side by side).
    int send_threads = 8;
    // The spread connections beyond the client's own are opened on first
    // need and kept for later calls (a call takes those it needs; calls at
    // once open more). One unused this long closes by itself, so an idle
    // client holds no connection open that a server's shutdown would wait
    // for; the next call reopens it. gRPC allows no less than a second.
    absl::Duration spread_connection_idle_timeout = absl::Seconds(5);
    // Sent as "authorization: Bearer <token>" when not empty.
    std::string bearer_token;
    // PEM roots to verify the server with; enables TLS when not empty.
    std::string tls_root_certs;
    // Client certificate and key (PEM) for mutual TLS.
    std::string tls_client_cert;
    std::string tls_client_key;
  };

  static absl::StatusOr<std::unique_ptr<LogpClient>> Create(
      const Options& options);
  // Unregisters the client's region, if any.
  ~LogpClient();

  // `model` empty: the default model; `model_version` 0: its latest version.
  // The answer lists every version the server holds of that model.
  absl::StatusOr<detlogp::v1::ModelInfo> GetModelInfo(
      const std::string& model = "", int64_t model_version = 0);
  // One call, cut into requests that fit the server's limits when larger;
  // the answer checked against the request (CheckLogProbResponse). The
  // whole call, every request it is cut into, ends by Options::timeout from
  // now, or by `deadline` when sooner (DEADLINE_EXCEEDED).
  absl::StatusOr<ScoreResult> Score(
      const detlogp::v1::LogProbRequest& request,
      absl::Time deadline = absl::InfiniteFuture());
  // The same for rows given beside the request: `header` carries neither
  // hidden.data nor a region (its shape and dtype say what `rows` hold), and
  // `rows` (read during the call only) are written once, straight into each
  // request's gRPC buffer (or into a system region with
  // Options::system_shared_memory), never copied into a message first;
  // INVALID_ARGUMENT naming hidden.data when they do not fill the shape.
  absl::StatusOr<ScoreResult> Score(
      const detlogp::v1::LogProbRequest& header, absl::string_view rows,
      absl::Time deadline = absl::InfiniteFuture());
  // The same for rows on a GPU (DeviceRows; one target per row): through
  // the client's CUDA region (Options::cuda_shared_memory), else copied to
  // the host. The caller keeps the rows unchanged until it returns.
  // INVALID_ARGUMENT naming the field for rows that are not device memory
  // on rows.device or do not match the targets; FAILED_PRECONDITION when no
  // CUDA runtime loads (rows on a GPU cannot be read without one);
  // RESOURCE_EXHAUSTED when the GPU has no room for the client's region.
  absl::StatusOr<ScoreResult> Score(
      const DeviceRows& rows, const std::vector<int64_t>& targets,
      const LogProbOptions& options, std::string request_id = "",
      absl::Time deadline = absl::InfiniteFuture());
  // Why a shared-memory region of the client's is not used: "system: ..."
  // and "cuda: ..." with the server's (or the runtime's) reason, joined by
  // "; " (empty while they are used, or were never asked for).
  std::string shared_memory_refusal() const;

  // Regions the caller manages itself (Triton's shared-memory calls); the
  // server checks every field and names the one it refuses. Requests name
  // them with MakeLogProbRequest(..., RegionRef, ...). A region belongs to
  // the bearer token that registered it.
  // Bytes [offset, offset + byte_size) of the POSIX shared-memory object
  // `key` (shm_open's name) as region `name`.
  absl::Status RegisterSystemRegion(const std::string& name,
                                    const std::string& key, int64_t offset,
                                    int64_t byte_size);
  // `byte_size` bytes from the base of the allocation `raw_handle` (the 64
  // bytes of its cudaIpcMemHandle_t) names, on CUDA device `device_id` as
  // the server numbers its GPUs.
  absl::Status RegisterCudaRegion(const std::string& name,
                                  const std::string& raw_handle,
                                  int64_t device_id, int64_t byte_size);
  // `name` empty: every region of that kind the caller may use.
  absl::Status UnregisterSystemRegion(const std::string& name);
  absl::Status UnregisterCudaRegion(const std::string& name);
  absl::StatusOr<detlogp::v1::SystemSharedMemoryStatusResponse>
  SystemRegionStatus(const std::string& name = "");
  absl::StatusOr<detlogp::v1::CudaSharedMemoryStatusResponse> CudaRegionStatus(
      const std::string& name = "");

  // Resolves the "dns:" targets now: their replicas become the addresses
  // found (a replica of an address found again is kept, with its window
  // and health). A name that fails to resolve keeps its replicas; the
  // first such failure is returned.
  absl::Status RefreshReplicas();
  // The targets of the replicas calls are spread over now, in order.
  std::vector<std::string> replica_targets();

  // Spread connections this client opened so far, and those of them kept
  // between calls that are connected now (not closed for idleness).
  int64_t spread_connections_opened() const;
  int spread_connections_connected() const;
  // Sends every request on one stream and returns the answers in order,
  // each checked against its request.
  absl::StatusOr<std::vector<ScoreResult>> ScoreStream(
      const std::vector<detlogp::v1::LogProbRequest>& requests,
      absl::Time deadline = absl::InfiniteFuture());

  // Streams the H3 projection of x ([rows, 96] fp32) and reassembles Y
  // ([rows, 5376]) in row order, checking offsets and shapes. `on_chunk`, if
  // set, sees each chunk as a ProjectResponse: that costs a copy of the
  // chunk's bytes (ProjectChunk::ToProto), so fast consumers use
  // ProjectChunks. It may take the chunk's bytes (swap y().data() out).
  struct ProjectResult {
    std::vector<float> y;  // empty when keep_output is false
    std::string determinism_key;
    int64_t chunks = 0;
    int streams = 1;  // Project calls it took (ProjectOptions::streams)
  };
  absl::StatusOr<ProjectResult> Project(
      const std::vector<float>& x, int64_t rows, int64_t rows_per_chunk = 0,
      bool keep_output = true,
      const std::function<void(detlogp::v1::ProjectResponse&)>& on_chunk = {});

  // The projection stream read raw: each response stays in gRPC's receive
  // buffers and only its header is parsed (client/project_chunk.h), so the
  // reading thread is back on the socket at once. Each chunk is checked
  // (row_offset follows the previous chunk, y is FLOAT32 [r, 5376] with r > 0
  // rows inside the request, y.data holds r * 5376 floats; otherwise
  // DATA_LOSS naming the field and the stream is cancelled), copied once to
  // `options.y` when set, then handed to `on_chunk`, which may keep it by
  // moving it out (no copy; the slices are reference-counted).
  // A program streaming many large chunks should call
  // RetainFreedHeapMemory and LimitMallocArenas (client/heap_retention.h)
  // once in main and run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1
  // (TunablesWithMallocHugePages): with glibc's defaults each chunk's freed
  // receive buffers go back to the OS and the next chunk is received into
  // freshly faulted 4 KiB pages.
  //
  // `streams` > 1 spreads the rows over that many Project calls, each on a
  // connection of its own (client/interleaved_rows.h): one gRPC stream is
  // read on one thread and tops out near 2.8 GB/s on an H200 host, several
  // side by side do not. Blocks of rows_per_chunk rows (kInterleavedBlockRows
  // when 0) go round the calls; chunks are still checked, copied to `y` (by
  // the reading threads, side by side) and handed to `on_chunk` one at a
  // time in row order, each call holding at most two chunks beyond it. The
  // bits are the same: each row's projection depends on that row alone.
  // Fewer calls run when there are fewer blocks. By default (kAutoStreams)
  // a projection of at least kAutoStreamsMinRows rows takes
  // kAutoStreamsCalls calls and a smaller one a single call, whose extra
  // connections would cost more than they save.
  struct ProjectOptions {
    // Rows per response message; 0 lets the server choose (one stream) or
    // kInterleavedBlockRows (several).
    int64_t rows_per_chunk = 0;
    // Where Y goes: rows * 5376 floats, row order. Null: not kept.
    float* y = nullptr;
    std::string request_id = "project";
    // Project calls side by side, each on its own connection; kAutoStreams
    // (0): chosen by the projection's size.
    int streams = 0;
  };
  static constexpr int kAutoStreams = 0;
  // 8192 rows are 176 MB of Y: ~70 ms on one stream of an H200 host,
  // ~25 ms over four calls, against a few ms to open three connections.
  static constexpr int64_t kAutoStreamsMinRows = 8192;
  static constexpr int kAutoStreamsCalls = 4;
  // The calls a projection of `rows` rows asks for (before InterleavedRows
  // caps them at its number of blocks).
  static int StreamsFor(int streams, int64_t rows) {
    if (streams != kAutoStreams) return streams;
    return rows >= kAutoStreamsMinRows ? kAutoStreamsCalls : 1;
  }
  // Rows per block of interleaved calls when rows_per_chunk is 0 (the
  // server's default chunk).
  static constexpr int64_t kInterleavedBlockRows = 512;
  absl::StatusOr<ProjectResult> ProjectChunks(
      const std::vector<float>& x, int64_t rows, const ProjectOptions& options,
      const std::function<void(ProjectChunk&)>& on_chunk = {});

  // Sets the deadline (Options::timeout from now, or `deadline` when
  // sooner) and credentials of a call made through stub().
  void PrepareContext(grpc::ClientContext* context,
                      absl::Time deadline = absl::InfiniteFuture()) const;

  detlogp::v1::LogProbService::Stub* stub() { return stub_.get(); }
  detlogp::v1::ProjectionService::Stub* projection_stub() {
    return projection_stub_.get();
  }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  const Options& options() const { return options_; }

 private:
  explicit LogpClient(const Options& options);

  // A channel for Project calls (ProjectionService/Project read as
  // grpc::ByteBuffer).
  struct ProjectionConnection {
    explicit ProjectionConnection(std::shared_ptr<grpc::Channel> channel_in);
    std::shared_ptr<grpc::Channel> channel;
  };
  struct Replica;
  using ReplicaList = std::vector<std::shared_ptr<Replica>>;
  absl::StatusOr<ProjectResult> ProjectInterleaved(
      const std::vector<float>& x, const InterleavedRows& plan,
      const ProjectOptions& options,
      const std::function<void(ProjectChunk&)>& on_chunk);

  // `request` as it is (rows in the message or named by reference), cut to
  // fit the server's limits and, with rows in the messages, spread over
  // connections. `rows_bytes`: the rows that go in the messages, the
  // request's own data or, with `rows_beside`, rows given beside a request
  // that carries none.
  // `only`: the replicas the request may go to (null: every replica).
  // `region_write`: rows of a request naming a region of the client's from
  // offset 0, not yet written there; the call is cut into pieces, all in
  // flight at once, each written by the thread that sends it.
  struct RegionWrite {
    char* region = nullptr;
    absl::string_view rows;
  };
  absl::StatusOr<ScoreResult> ScoreCut(
      const detlogp::v1::LogProbRequest& request, absl::string_view rows_bytes,
      bool rows_beside, absl::Time deadline, const ReplicaList* only = nullptr,
      const RegionWrite* region_write = nullptr);
  // A connection of its own for the requests of spread calls.
  struct RawConnection {
    explicit RawConnection(std::shared_ptr<grpc::Channel> channel_in);
    std::shared_ptr<grpc::Channel> channel;
  };
  // One server of Options::targets (or one address of a "dns:" target):
  // its channel, and what the client's calls share of it. Held by
  // shared_ptr: calls under way, and a background ModelInfo ask, may
  // outlive its place in the client's set (or the client).
  struct Replica {
    Replica(uint64_t id_in, std::string target_in, std::string tls_name_in,
            std::shared_ptr<grpc::Channel> channel_in,
            int64_t assumed_queue_rows,
            const ReplicaHealth::Options& health_options,
            std::function<void(grpc::ClientContext*)> prepare);
    // Unique within the client (regions remember replicas by it).
    const uint64_t id;
    const std::string target;
    // The name its certificate carries (a "dns:" name's address), or empty.
    const std::string tls_name;
    const std::shared_ptr<grpc::Channel> channel;
    const std::unique_ptr<detlogp::v1::LogProbService::Stub> stub;
    // The client's regions registered on this replica.
    RegionApi regions;
    RowWindow window;
    ReplicaHealth health;
    // Left the client's set (its address left DNS): calls under way send
    // it no new request.
    std::atomic<bool> retired{false};
    // The replica refused a region of that kind (another host): not asked
    // again.
    std::atomic<bool> refuses_system{false};
    std::atomic<bool> refuses_cuda{false};
    absl::Mutex mu;
    // Spread connections kept between calls, not in use by one.
    std::vector<std::unique_ptr<RawConnection>> idle_spread ABSL_GUARDED_BY(mu);
    // The replica's ModelInfo once it answered, whether an ask is out, and
    // when a failed ask may be tried again.
    std::optional<detlogp::v1::ModelInfo> info ABSL_GUARDED_BY(mu);
    bool asking ABSL_GUARDED_BY(mu) = false;
    absl::Time ask_again ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  };
  // Asks `replica`'s ModelInfo in the background unless it answered or is
  // being asked; its answer sets the replica's window.
  void AskLimitsInBackground(const std::shared_ptr<Replica>& replica,
                             const std::string& model);
  // Spread connections to `replica` beyond its own: taken by a call (kept
  // ones first, new ones opened as needed) and given back after it.
  std::vector<std::unique_ptr<RawConnection>> TakeSpreadConnections(
      Replica& replica, int count);
  void GiveBackSpreadConnections(
      Replica& replica,
      std::vector<std::unique_ptr<RawConnection>> connections);
  // The replicas calls are spread over now; resolves the "dns:" targets
  // first when that is due (one caller resolves, the others go on with
  // the replicas they find).
  ReplicaList Replicas();
  // A new replica of `target` (its channel made).
  std::shared_ptr<Replica> NewReplica(const std::string& target,
                                      const std::string& tls_name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(replicas_mu_);
  absl::Time Now() const;
  // Which replicas hold one of the client's regions: registered (kept
  // weakly: a replica gone from the set releases an idle region itself)
  // or refused. Touched only by the call the region is lent to.
  struct RegionPlaces {
    std::map<uint64_t, std::weak_ptr<Replica>> registered;
    std::set<uint64_t> refused;
  };
  // How a region of one kind is registered and released on a replica.
  struct RegionKind {
    std::function<absl::Status(RegionApi&)> register_on;
    std::function<void(RegionApi&)> unregister_on;
    // The replica's flag that it refuses this kind.
    std::atomic<bool> Replica::*refuses;
    std::function<bool(absl::StatusCode)> is_refusal;
  };
  // Registers a region with each replica of `replicas` that has not
  // answered for it and may be asked now (up, or due for a probe; a replica
  // that does not answer is marked failed). Returns the replicas of
  // `replicas` that hold it; `*missing` says whether one that may be asked
  // was not (`can_register` false: the region's name is gone); `*refusal`
  // is a refusal seen, `*failure` another error.
  ReplicaList PlaceRegion(RegionPlaces& places, const RegionKind& kind,
                          const ReplicaList& replicas, bool can_register,
                          bool* missing, absl::Status* refusal,
                          absl::Status* failure);
  // Unregisters a region from every replica that holds it and answers.
  void UnplaceRegion(const RegionPlaces& places, const RegionKind& kind);
  // The rows a request may carry on this server (0: unknown, no cutting).
  // The server is asked once, for a call to be spread or one beyond what
  // its default limits always take.
  absl::StatusOr<int64_t> RowsPerRequest(
      const detlogp::v1::LogProbRequest& request, bool by_reference,
      bool spread, const ReplicaList& replicas);
  // A system region the client owns, lent to one call at a time.
  struct SystemRegion {
    std::unique_ptr<SystemSharedMemory> memory;
    std::string name;
    RegionPlaces places;
    int64_t bytes() const { return memory->bytes(); }
  };
  RegionKind SystemKind(const SystemRegion& region);
  // Through one of the client's system regions (taken from the pool, made
  // or grown and registered as needed): `data`, the request's hidden bytes
  // (its own, or given beside it), copied in and named. nullopt when there
  // are no bytes to move or the server refused regions (the caller sends
  // the bytes).
  absl::StatusOr<std::optional<ScoreResult>> ScoreThroughSystemRegion(
      const detlogp::v1::LogProbRequest& request, absl::string_view data,
      absl::Time deadline);
  // Registered with every replica of `replicas` that accepts it, then its
  // name unlinked (a replica that joins later gets the regions made after).
  absl::StatusOr<std::unique_ptr<SystemRegion>> MakeSystemRegion(
      int64_t bytes, const ReplicaList& replicas);
  void ReleaseSystemRegion(const SystemRegion& region);
  // Unregisters the pool's idle regions; how many there were.
  int ReleaseIdleSystemRegions();

  // The CUDA runtime, loaded on first need (or why it did not load).
  absl::StatusOr<const CudaRuntime*> Cuda();
  // A CUDA region of the client's on one GPU, lent to one call at a time.
  struct CudaRegion {
    std::unique_ptr<DeviceMemory> memory;
    std::string name;
    std::string handle;
    int device = 0;
    RegionPlaces places;
    int64_t bytes() const { return memory->bytes(); }
  };
  RegionKind CudaKind(const CudaRegion& region);
  // Through the client's CUDA region on rows.device: nullopt when the
  // region is off or refused (the caller takes the host path).
  absl::StatusOr<std::optional<ScoreResult>> ScoreThroughCudaRegion(
      const CudaRuntime& cuda, const DeviceRows& rows,
      const detlogp::v1::LogProbRequest& request, absl::Time deadline);
  // A new region on `device` of at least `bytes`, registered (the server's
  // refusal as its status).
  absl::StatusOr<std::unique_ptr<CudaRegion>> MakeCudaRegion(
      const CudaRuntime& cuda, int device, int64_t bytes,
      const ReplicaList& replicas);
  void ReleaseCudaRegion(const CudaRegion& region);
  // The pool of `device`'s regions, made on first need.
  RegionPool<CudaRegion>& CudaPool(int device);
  // Why a CUDA region was refused ("" while they are used).
  std::string CudaRefusal() const;

  Options options_;
  // One of Options::targets (or Options::target alone) and its replicas
  // now: itself, or the addresses its "dns:" name resolved to.
  struct TargetEntry {
    std::string target;
    std::optional<DnsName> dns;
    ReplicaList replicas;
  };
  mutable absl::Mutex replicas_mu_;
  std::vector<TargetEntry> entries_ ABSL_GUARDED_BY(replicas_mu_);
  // The entries' replicas in order: what calls are spread over.
  ReplicaList replicas_ ABSL_GUARDED_BY(replicas_mu_);
  absl::Time next_resolve_ ABSL_GUARDED_BY(replicas_mu_) =
      absl::InfiniteFuture();
  uint64_t next_replica_id_ ABSL_GUARDED_BY(replicas_mu_) = 0;
  // Held by the caller resolving the names.
  absl::Mutex resolve_mu_;
  // The first target's: the control calls and calls naming a caller's
  // region (a replica of the scoring set, or for a "dns:" target one on
  // the name).
  std::shared_ptr<Replica> control_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<detlogp::v1::LogProbService::Stub> stub_;
  std::unique_ptr<RegionApi> regions_api_;
  // How long the client waits for the server to release one of its regions.
  static constexpr absl::Duration kReleaseTimeout = absl::Seconds(5);
  // The limits calls are cut to, once a replica answered.
  absl::Mutex limits_mu_;
  std::optional<detlogp::v1::ModelInfo> limits_ ABSL_GUARDED_BY(limits_mu_);
  // The client's system regions, each lent to one call at a time.
  RegionPool<SystemRegion> system_regions_;
  // Why the server refused a system region, once it has.
  mutable absl::Mutex shared_memory_mu_;
  std::string shared_memory_refusal_ ABSL_GUARDED_BY(shared_memory_mu_);
  // The CUDA runtime; loaded once, kept until the regions are freed.
  absl::Mutex cuda_runtime_mu_;
  std::optional<absl::StatusOr<std::unique_ptr<CudaRuntime>>> cuda_runtime_
      ABSL_GUARDED_BY(cuda_runtime_mu_);
  // The client's CUDA regions, a pool per device; each region lent to one
  // call at a time. The mutex guards the map and the refusal, never a call.
  mutable absl::Mutex cuda_mu_;
  std::map<int, std::unique_ptr<RegionPool<CudaRegion>>> cuda_pools_
      ABSL_GUARDED_BY(cuda_mu_);
  std::string cuda_refusal_ ABSL_GUARDED_BY(cuda_mu_);
  // Options::send_threads, for every call's requests.
  std::unique_ptr<TaskPool> senders_;
  // How many spread connections were opened.
  mutable absl::Mutex spread_mu_;
  int64_t spread_opened_ ABSL_GUARDED_BY(spread_mu_) = 0;
  std::unique_ptr<detlogp::v1::ProjectionService::Stub> projection_stub_;
  // channel_'s: one-stream projections and the first interleaved call. The
  // other interleaved calls get connections of their own for the length of
  // the projection (an idle connection holds a server's SIGTERM drain).
  std::unique_ptr<ProjectionConnection> projection_;
};

// A request's rows [begin, begin + count) as a request of their own: its
// hidden bytes (or its shared-memory reference, moved by the rows before),
// targets, and every other field as they are.
detlogp::v1::LogProbRequest SliceLogProbRequest(
    const detlogp::v1::LogProbRequest& request, int64_t begin, int64_t count);

// A channel as LogpClient makes it (message limits, TLS, load balancing);
// `options.bearer_token` and `options.timeout` belong to calls, not here.
// `tls_name`: the name the server's certificate must carry when it is not
// the target's (an address a "dns:" name resolved to).
std::shared_ptr<grpc::Channel> MakeChannel(const LogpClient::Options& options,
                                           const std::string& tls_name = "");

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_LOGP_CLIENT_H_
