#include "server/backends/cuda_vocab_parallel.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/split_policy.h"
#include "server/backends/cuda_buffers.h"

namespace detlogp::server {
namespace {

using kernels::cuda::LinearLogpBatchView;
using kernels::cuda::LinearLogpCuda;

// Per-shard device buffers and stream of one executor.
struct ShardLane {
  const CudaLmHead* shard = nullptr;
  cudaStream_t stream = nullptr;
  DeviceBuffer inputs;     // [local targets | temperatures | hidden]
  DeviceBuffer split_lse;  // [capacity][shard splits]
  DeviceBuffer z;          // [capacity]: z[target] for targets it holds
  PinnedBuffer host_z;     // [capacity]
  PinnedBuffer host_local_targets;  // [capacity]
};

class VocabParallelExecutor final : public LogpExecutor {
 public:
  VocabParallelExecutor(int64_t hidden_size, int32_t total_splits,
                        int64_t capacity)
      : hidden_size_(hidden_size),
        total_splits_(total_splits),
        capacity_(capacity + capacity % 2),
        layout_{capacity_} {}

  ~VocabParallelExecutor() override {
    for (auto& lane : lanes_) {
      if (lane->stream != nullptr) cudaStreamDestroy(lane->stream);
    }
  }

  absl::Status Init(const std::vector<std::unique_ptr<CudaLmHead>>& shards) {
    const size_t input_bytes = layout_.input_bytes(hidden_size_);
    if (absl::Status s = host_inputs_.Allocate(input_bytes, "cudaHostAlloc");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = host_outputs_.Allocate(layout_.output_bytes(),
                                                "cudaHostAlloc");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = host_split_lse_.Allocate(
            capacity_ * total_splits_ * sizeof(float), "cudaHostAlloc");
        !s.ok()) {
      return s;
    }
    for (size_t g = 0; g < shards.size(); ++g) {
      lanes_.push_back(std::make_unique<ShardLane>());
      ShardLane& lane = *lanes_.back();
      lane.shard = shards[g].get();
      const int32_t splits = lane.shard->end_split - lane.shard->first_split;
      DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(lane.shard->device), "cudaSetDevice");
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking),
          "cudaStreamCreate");
      for (auto [buffer, bytes] :
           {std::pair{&lane.inputs, input_bytes},
            {&lane.split_lse, capacity_ * splits * sizeof(float)},
            {&lane.z, capacity_ * sizeof(float)}}) {
        if (absl::Status s = buffer->Allocate(bytes, "cudaMalloc"); !s.ok()) return s;
      }
      for (auto [buffer, bytes] : {std::pair{&lane.host_z, capacity_ * sizeof(float)},
                                   {&lane.host_local_targets, capacity_ * sizeof(int32_t)}}) {
        if (absl::Status s = buffer->Allocate(bytes, "cudaHostAlloc"); !s.ok()) return s;
      }
    }
    // The combine runs on the first shard's GPU.
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(lanes_[0]->shard->device), "cudaSetDevice");
    for (auto [buffer, bytes] :
         {std::pair{&combine_split_lse_, capacity_ * total_splits_ * sizeof(float)},
          {&combine_outputs_, 2 * capacity_ * sizeof(float)}}) {
      if (absl::Status s = buffer->Allocate(bytes, "cudaMalloc"); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  LogpStaging staging() override {
    return layout_.View(host_inputs_.as<void>(), host_outputs_.as<void>());
  }

  absl::Status Run(int64_t rows) override {
    if (rows > capacity_) return absl::InternalError("batch exceeds staging");
    if (rows == 0) return absl::OkStatus();
    const LogpStaging host = staging();
    // 1. Every shard computes its splits; they run concurrently.
    for (auto& lane : lanes_) {
      if (absl::Status s = LaunchShard(*lane, host, rows); !s.ok()) {
        SyncAll();
        return s;
      }
    }
    absl::Status synced = SyncAll();
    if (!synced.ok()) return synced;
    // 2. z[target] comes from the shard holding the target (a copy, no
    // arithmetic); the partials already sit in split order.
    float* z = host.logprobs;
    for (int64_t r = 0; r < rows; ++r) {
      for (const auto& lane : lanes_) {
        if (host.targets[r] >= lane->shard->first_row &&
            host.targets[r] < lane->shard->end_row) {
          z[r] = lane->host_z.as<float>()[r];
        }
      }
    }
    // 3. The single-GPU fold, on the first shard's GPU.
    const ShardLane& first = *lanes_[0];
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(first.shard->device), "cudaSetDevice");
    float* device_split_lse = combine_split_lse_.as<float>();
    float* device_logprobs = combine_outputs_.as<float>();
    float* device_lse = device_logprobs + capacity_;
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(device_split_lse, host_split_lse_.as<void>(),
                        rows * total_splits_ * sizeof(float),
                        cudaMemcpyHostToDevice, first.stream),
        "copy partials to the combining GPU");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(device_logprobs, z, rows * sizeof(float),
                        cudaMemcpyHostToDevice, first.stream),
        "copy z[target] to the combining GPU");
    if (absl::Status s = LinearLogpCuda::LaunchCombine(
            device_split_lse, total_splits_, rows, device_logprobs, device_lse,
            first.shard->device, first.stream);
        !s.ok()) {
      cudaStreamSynchronize(first.stream);
      return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host.logprobs, device_logprobs, rows * sizeof(float),
                        cudaMemcpyDeviceToHost, first.stream),
        "copy logprobs to host");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(host.lse, device_lse, rows * sizeof(float),
                        cudaMemcpyDeviceToHost, first.stream),
        "copy lse to host");
    return CudaStatus(cudaStreamSynchronize(first.stream), "combine on the GPU");
  }

 private:
  absl::Status LaunchShard(ShardLane& lane, const LogpStaging& host, int64_t rows) {
    const CudaLmHead& shard = *lane.shard;
    int32_t* local_targets = lane.host_local_targets.as<int32_t>();
    for (int64_t r = 0; r < rows; ++r) {
      local_targets[r] = static_cast<int32_t>(host.targets[r] - shard.first_row);
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(shard.device), "cudaSetDevice");
    // Only the inputs block's layout is used on a shard (no outputs block).
    const LogpStaging device = layout_.View(lane.inputs.as<void>(), nullptr);
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(device.targets, local_targets, rows * sizeof(int32_t),
                        cudaMemcpyHostToDevice, lane.stream),
        "copy targets to a shard");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(device.temperatures, host.temperatures,
                        rows * sizeof(float), cudaMemcpyHostToDevice, lane.stream),
        "copy temperatures to a shard");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(device.hidden, host.hidden, rows * hidden_size_ * 2,
                        cudaMemcpyHostToDevice, lane.stream),
        "copy hidden to a shard");
    LinearLogpBatchView batch;
    batch.targets = device.targets;
    batch.temperatures = device.temperatures;
    batch.hidden = reinterpret_cast<const __nv_bfloat16*>(device.hidden);
    batch.logprobs = lane.z.as<float>();
    batch.rows = rows;
    if (absl::Status s = shard.kernel->LaunchSplits(batch, lane.split_lse.as<float>(),
                                                    lane.stream);
        !s.ok()) {
      return s;
    }
    // The shard's [rows][splits] block lands in columns [first, end) of the
    // host's [rows][total_splits] table: ascending split order.
    const int32_t splits = shard.end_split - shard.first_split;
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpy2DAsync(host_split_lse_.as<float>() + shard.first_split,
                          total_splits_ * sizeof(float), lane.split_lse.as<void>(),
                          splits * sizeof(float), splits * sizeof(float), rows,
                          cudaMemcpyDeviceToHost, lane.stream),
        "copy partials from a shard");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(lane.host_z.as<void>(), lane.z.as<void>(),
                        rows * sizeof(float), cudaMemcpyDeviceToHost, lane.stream),
        "copy z from a shard");
    return absl::OkStatus();
  }

  absl::Status SyncAll() {
    absl::Status first_error;
    for (auto& lane : lanes_) {
      cudaSetDevice(lane->shard->device);
      absl::Status s = CudaStatus(cudaStreamSynchronize(lane->stream), "shard on the GPU");
      if (first_error.ok()) first_error = s;
    }
    return first_error;
  }

  const int64_t hidden_size_;
  const int32_t total_splits_;
  const int64_t capacity_;
  const BatchLayout layout_;
  PinnedBuffer host_inputs_, host_outputs_, host_split_lse_;
  DeviceBuffer combine_split_lse_, combine_outputs_;
  std::vector<std::unique_ptr<ShardLane>> lanes_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<CudaLmHead>>> UploadVocabShards(
    const LmHeadWeights& weights, const std::vector<int>& devices) {
  const int32_t splits = kernels::NumVocabSplits(weights.vocab_size);
  const int shards = static_cast<int>(devices.size());
  if (shards < 1 || shards > splits) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocabulary parallelism over ", shards, " GPUs needs 1..", splits,
        " of them"));
  }
  std::vector<std::unique_ptr<CudaLmHead>> out;
  for (int g = 0; g < shards; ++g) {
    auto shard = UploadLmHead(weights, devices[g], splits * g / shards,
                              splits * (g + 1) / shards);
    if (!shard.ok()) return shard.status();
    out.push_back(*std::move(shard));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<LogpExecutor>> NewVocabParallelExecutor(
    const std::vector<std::unique_ptr<CudaLmHead>>& shards, int64_t hidden_size,
    int64_t vocab_size, int64_t capacity) {
  auto executor = std::make_unique<VocabParallelExecutor>(
      hidden_size, kernels::NumVocabSplits(vocab_size), capacity);
  if (absl::Status s = executor->Init(shards); !s.ok()) return s;
  return std::unique_ptr<LogpExecutor>(std::move(executor));
}

}  // namespace detlogp::server
