// LogpClient's H3 projection: one Project stream read raw, or several side
// by side (client/interleaved_rows.h) put back into row order.
#include <grpcpp/completion_queue.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/byte_buffer.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/grpc_lifetime.h"
#include "client/interleaved_rows.h"
#include "client/logp_client.h"

namespace detlogp::client {
namespace {

// ProjectionService/Project's path (the generated stub's lives in a
// file-scope array of detlogp.grpc.pb.cc).
constexpr char kRawProjectMethod[] = "/detlogp.v1.ProjectionService/Project";
constexpr int64_t kIn = 96;
constexpr int64_t kOut = 5376;
// Chunks a call may have received ahead of the one handed on in row order.
constexpr size_t kChunksAheadPerCall = 2;

// OK when `chunk` is the next one of a FLOAT32 [rows, kOut] projection
// whose rows up to `next_row` have arrived; its row count in `chunk_rows`.
absl::Status CheckChunk(const ProjectChunk& chunk, int64_t next_row,
                        int64_t rows, int64_t* chunk_rows) {
  if (chunk.row_offset != next_row) {
    return absl::DataLossError(
        absl::StrCat("ProjectResponse.row_offset: ", chunk.row_offset,
                     ", expected the next row ", next_row));
  }
  if (chunk.y_dtype != detlogp::v1::DTYPE_FLOAT32) {
    return absl::DataLossError(absl::StrCat(
        "ProjectResponse.y.dtype: ", detlogp::v1::DType_Name(chunk.y_dtype),
        " at row ", next_row, ", expected DTYPE_FLOAT32"));
  }
  if (chunk.y_shape.size() != 2 || chunk.y_shape[0] <= 0 ||
      chunk.y_shape[1] != kOut || chunk.y_shape[0] > rows - next_row) {
    std::string shape;
    for (int64_t d : chunk.y_shape)
      absl::StrAppend(&shape, shape.empty() ? "" : ", ", d);
    return absl::DataLossError(
        absl::StrCat("ProjectResponse.y.shape: [", shape, "] at row ", next_row,
                     ", expected [r, ", kOut,
                     "] with 0 < r <= ", rows - next_row, " (rows left)"));
  }
  *chunk_rows = chunk.y_shape[0];
  const int64_t want_bytes =
      *chunk_rows * kOut * static_cast<int64_t>(sizeof(float));
  if (chunk.y_data_bytes != want_bytes) {
    return absl::DataLossError(absl::StrCat(
        "ProjectResponse.y.data: ", chunk.y_data_bytes, " bytes at row ",
        next_row, ", expected ", want_bytes, " for ", *chunk_rows, " rows"));
  }
  return absl::OkStatus();
}

detlogp::v1::ProjectRequest MakeProjectRequest(const float* x, int64_t rows,
                                               int64_t rows_per_chunk,
                                               const std::string& request_id) {
  detlogp::v1::ProjectRequest request;
  request.set_request_id(request_id);
  request.set_rows_per_chunk(rows_per_chunk);
  detlogp::v1::Tensor* tensor = request.mutable_x();
  tensor->set_dtype(detlogp::v1::DTYPE_FLOAT32);
  tensor->add_shape(rows);
  tensor->add_shape(kIn);
  tensor->set_data(reinterpret_cast<const char*>(x),
                   static_cast<size_t>(rows * kIn) * sizeof(float));
  return request;
}

// One server-streaming call read on the calling thread through gRPC's
// public generic API and a completion queue of its own: the request goes as
// the only message, and each Read waits for the next response, left in
// gRPC's buffer (nothing parsed or copied). One operation is outstanding at
// a time, so each wait is for the operation just started.
class RawStreamReader {
 public:
  RawStreamReader(const std::shared_ptr<grpc::Channel>& channel,
                  grpc::ClientContext* context, grpc::ByteBuffer request)
      : request_(std::move(request)) {
    grpc::GenericStub stub(channel);
    call_ = stub.PrepareCall(context, method_, &queue_);
    call_->StartCall(this);
    open_ = Wait();
    if (open_) {
      call_->WriteLast(request_, grpc::WriteOptions(), this);
      open_ = Wait();
    }
  }
  RawStreamReader(const RawStreamReader&) = delete;
  RawStreamReader& operator=(const RawStreamReader&) = delete;
  ~RawStreamReader() {
    queue_.Shutdown();
    void* tag;
    bool ok;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  // The next response into `message`; false once the stream ended.
  bool Read(grpc::ByteBuffer* message) {
    if (!open_) return false;
    call_->Read(message, this);
    open_ = Wait();
    return open_;
  }

  // The call's status; after the last Read.
  grpc::Status Finish() {
    grpc::Status status;
    call_->Finish(&status, this);
    Wait();
    return status;
  }

 private:
  // The operation just started: whether it succeeded.
  bool Wait() {
    void* tag = nullptr;
    bool ok = false;
    if (!queue_.Next(&tag, &ok)) return false;
    return ok;
  }

  // gRPC keeps a pointer to the method's name for the call's life.
  const std::string method_ = kRawProjectMethod;
  grpc::ByteBuffer request_;
  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool open_ = false;
};

// Gets each checked chunk of one stream with its row count; a non-OK status
// ends the stream with that status.
using ChunkSink =
    std::function<absl::Status(ProjectChunk&, int64_t chunk_rows)>;

// Reads one Project stream of `rows` rows raw: each chunk's header parsed
// (client/project_chunk.h) and checked, y.data left in gRPC's slices.
absl::Status ReadProjectStream(const std::shared_ptr<grpc::Channel>& channel,
                               grpc::ClientContext* context,
                               const detlogp::v1::ProjectRequest& request,
                               int64_t rows, const ChunkSink& sink) {
  grpc::ByteBuffer serialized;
  bool own_buffer = false;
  if (grpc::Status s = grpc::GenericSerialize<grpc::ProtoBufferWriter,
                                              detlogp::v1::ProjectRequest>(
          request, &serialized, &own_buffer);
      !s.ok()) {
    return FromGrpcStatus(s);
  }
  auto reader = std::make_unique<RawStreamReader>(channel, context,
                                                  std::move(serialized));
  int64_t next_row = 0;
  grpc::ByteBuffer message;
  absl::Status problem;
  while (reader->Read(&message)) {
    absl::StatusOr<ProjectChunk> chunk = ParseProjectChunk(message);
    message.Clear();
    int64_t chunk_rows = 0;
    if (chunk.ok()) {
      problem = CheckChunk(*chunk, next_row, rows, &chunk_rows);
    } else {
      problem = absl::Status(chunk.status().code(),
                             absl::StrCat(chunk.status().message(),
                                          " (chunk at row ", next_row, ")"));
    }
    if (problem.ok()) problem = sink(*chunk, chunk_rows);
    if (!problem.ok()) {
      context->TryCancel();
      break;
    }
    next_row += chunk_rows;
  }
  if (!problem.ok()) {
    while (reader->Read(&message)) {
    }
  }
  const grpc::Status status = reader->Finish();
  if (!problem.ok()) return problem;
  if (!status.ok()) return FromGrpcStatus(status);
  if (next_row != rows) {
    return absl::DataLossError(absl::StrCat("projection stream ended at row ",
                                            next_row, " of ", rows));
  }
  return absl::OkStatus();
}

// The calls of one interleaved projection: what each has received ahead of
// the row-order hand-over, and the first failure, which stops them all.
class InterleavedCalls {
 public:
  explicit InterleavedCalls(int calls) : ready_(calls), ended_(calls, false) {
    for (int c = 0; c < calls; ++c) {
      contexts_.push_back(std::make_unique<grpc::ClientContext>());
    }
  }

  grpc::ClientContext* context(int call) { return contexts_[call].get(); }

  // Every chunk of a projection carries the server's key; calls that
  // disagree are a failure.
  absl::Status CheckKey(int call, const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    if (key_.empty()) {
      key_ = key;
    } else if (key != key_) {
      return absl::DataLossError(absl::StrCat(
          "ProjectResponse.determinism_key: call ", call,
          " of the projection answered ", key, ", another ", key_));
    }
    return absl::OkStatus();
  }

  // Queues a call's next chunk, waiting while it is kChunksAheadPerCall
  // ahead; CANCELLED once another call failed.
  absl::Status Push(int call, ProjectChunk chunk) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] {
      return !failure_.ok() || ready_[call].size() < kChunksAheadPerCall;
    });
    if (!failure_.ok())
      return absl::CancelledError("another call of the projection failed");
    ready_[call].push_back(std::move(chunk));
    changed_.notify_all();
    return absl::OkStatus();
  }

  // The call's next chunk, once it has arrived; false when the projection
  // failed or the call ended without it.
  bool Pop(int call, ProjectChunk* chunk) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] {
      return !failure_.ok() || !ready_[call].empty() || ended_[call];
    });
    if (!failure_.ok() || ready_[call].empty()) return false;
    *chunk = std::move(ready_[call].front());
    ready_[call].pop_front();
    changed_.notify_all();
    return true;
  }

  // Records how a call ended; the first failure cancels every call.
  void End(int call, absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    ended_[call] = true;
    if (!status.ok() && failure_.ok()) {
      failure_ = std::move(status);
      for (auto& context : contexts_) context->TryCancel();
    }
    changed_.notify_all();
  }

  // After every call ended.
  absl::Status failure() const { return failure_; }
  std::string key() const { return key_; }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::vector<std::deque<ProjectChunk>> ready_;
  std::vector<bool> ended_;
  absl::Status failure_;
  std::string key_;
};

}  // namespace

absl::StatusOr<LogpClient::ProjectResult> LogpClient::Project(
    const std::vector<float>& x, int64_t rows, int64_t rows_per_chunk,
    bool keep_output,
    const std::function<void(detlogp::v1::ProjectResponse&)>& on_chunk) {
  ProjectOptions options;
  options.rows_per_chunk = rows_per_chunk;
  std::vector<float> y;
  if (keep_output && rows > 0 && static_cast<int64_t>(x.size()) == rows * kIn) {
    y.resize(rows * kOut);
    options.y = y.data();
  }
  std::function<void(ProjectChunk&)> as_proto;
  if (on_chunk) {
    as_proto = [&](ProjectChunk& chunk) {
      detlogp::v1::ProjectResponse response = chunk.ToProto();
      on_chunk(response);
    };
  }
  absl::StatusOr<ProjectResult> result =
      ProjectChunks(x, rows, options, as_proto);
  if (result.ok()) result->y = std::move(y);
  return result;
}

absl::StatusOr<LogpClient::ProjectResult> LogpClient::ProjectChunks(
    const std::vector<float>& x, int64_t rows, const ProjectOptions& options,
    const std::function<void(ProjectChunk&)>& on_chunk) {
  if (absl::Status usable = CheckGrpcUsableInThisProcess(); !usable.ok()) {
    return usable;
  }
  if (rows < 0 || static_cast<int64_t>(x.size()) != rows * kIn) {
    return absl::InvalidArgumentError("x must hold rows * 96 floats");
  }
  if (options.streams < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("streams: ", options.streams,
                     ", expected 0 (by the projection's size) or more"));
  }
  if (options.rows_per_chunk < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows_per_chunk: ", options.rows_per_chunk,
                     ", expected 0 (the server's) or more"));
  }
  const InterleavedRows plan(rows,
                             options.rows_per_chunk > 0 ? options.rows_per_chunk
                                                        : kInterleavedBlockRows,
                             StreamsFor(options.streams, rows));
  if (plan.calls() > 1) return ProjectInterleaved(x, plan, options, on_chunk);

  const detlogp::v1::ProjectRequest request = MakeProjectRequest(
      x.data(), rows, options.rows_per_chunk, options.request_id);
  grpc::ClientContext context;
  PrepareContext(&context);
  ProjectResult result;
  int64_t next_row = 0;
  const absl::Status status =
      ReadProjectStream(projection_->channel, &context, request, rows,
                        [&](ProjectChunk& chunk, int64_t chunk_rows) {
                          if (result.determinism_key.empty())
                            result.determinism_key = chunk.determinism_key;
                          if (options.y != nullptr)
                            chunk.CopyYTo(options.y + next_row * kOut);
                          if (on_chunk) on_chunk(chunk);
                          next_row += chunk_rows;
                          ++result.chunks;
                          return absl::OkStatus();
                        });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<LogpClient::ProjectResult> LogpClient::ProjectInterleaved(
    const std::vector<float>& x, const InterleavedRows& plan,
    const ProjectOptions& options,
    const std::function<void(ProjectChunk&)>& on_chunk) {
  // A connection of its own for every call but the first: one TCP
  // connection's bytes are read on one thread, whatever the streams on it.
  std::vector<std::unique_ptr<ProjectionConnection>> own;
  std::vector<ProjectionConnection*> connections = {projection_.get()};
  Options own_options = options_;
  own_options.own_connection = true;
  for (int c = 1; c < plan.calls(); ++c) {
    own.push_back(
        std::make_unique<ProjectionConnection>(MakeChannel(own_options)));
    connections.push_back(own.back().get());
  }
  InterleavedCalls calls(plan.calls());
  std::vector<std::thread> readers;
  for (int c = 0; c < plan.calls(); ++c) {
    readers.emplace_back([&, c] {
      detlogp::v1::ProjectRequest request;
      {
        const std::vector<float> call_x = plan.GatherCallRows(x.data(), kIn, c);
        request = MakeProjectRequest(
            call_x.data(), plan.CallRows(c), plan.block_rows(),
            absl::StrCat(options.request_id, "/", c + 1, "of", plan.calls()));
      }
      grpc::ClientContext* context = calls.context(c);
      PrepareContext(context);
      int64_t block = c;
      const absl::Status status = ReadProjectStream(
          connections[c]->channel, context, request, plan.CallRows(c),
          [&](ProjectChunk& chunk, int64_t chunk_rows) {
            const int64_t row = block * plan.block_rows();
            if (chunk_rows != plan.BlockRows(block)) {
              return absl::DataLossError(absl::StrCat(
                  "ProjectResponse.y.shape: ", chunk_rows, " rows at row ", row,
                  ", expected the ", plan.BlockRows(block),
                  " of rows_per_chunk (interleaved calls)"));
            }
            absl::Status key = calls.CheckKey(c, chunk.determinism_key);
            if (!key.ok()) return key;
            if (options.y != nullptr) chunk.CopyYTo(options.y + row * kOut);
            chunk.row_offset = row;
            block += plan.calls();
            return on_chunk ? calls.Push(c, std::move(chunk))
                            : absl::OkStatus();
          });
      calls.End(c, status);
    });
  }
  ProjectResult result;
  if (on_chunk) {
    ProjectChunk chunk;
    for (int64_t b = 0; b < plan.blocks(); ++b) {
      if (!calls.Pop(plan.CallOfBlock(b), &chunk)) break;
      on_chunk(chunk);
      chunk = ProjectChunk();  // gRPC's slices go back before the next wait
    }
  }
  for (std::thread& reader : readers) reader.join();
  if (!calls.failure().ok()) return calls.failure();
  result.determinism_key = calls.key();
  result.chunks = plan.blocks();
  result.streams = plan.calls();
  return result;
}

LogpClient::ProjectionConnection::ProjectionConnection(
    std::shared_ptr<grpc::Channel> channel_in)
    : channel(std::move(channel_in)) {}

}  // namespace detlogp::client
