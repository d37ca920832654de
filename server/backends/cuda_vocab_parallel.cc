#include "server/backends/cuda_vocab_parallel.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/split_policy.h"
#include "server/backends/cuda_buffers.h"

namespace detlogp::server {
namespace {

using kernels::cuda::LinearLogpBatchView;
using kernels::cuda::LinearLogpCuda;
using kernels::cuda::SplitPartials;

// Bytes of `splits` splits' partials for `rows` rows with these extras
// (LinearLogpCuda::PartitionWorkspace's layout, top-k screens included).
size_t PartialsBytes(int64_t rows, int32_t splits, const LogpExtras& extras) {
  return LinearLogpCuda::PartialsBytes(rows, splits, extras.entropy,
                                       extras.top_k);
}

SplitPartials Partition(void* block, int64_t rows, int32_t splits,
                        const LogpExtras& extras) {
  return LinearLogpCuda::PartitionWorkspace(block, rows, splits, extras.entropy,
                                            extras.top_k);
}

// Per-GPU device buffers and stream of one executor.
struct ShardLane {
  int device = 0;
  cudaStream_t stream = nullptr;
  DeviceBuffer inputs;    // [local targets | temperatures | hidden]
  DeviceBuffer partials;  // the shard's splits' partials for a batch
  DeviceBuffer z;         // [capacity]: z[target] for targets it holds
  PinnedBuffer host_z;    // [capacity]
  PinnedBuffer host_local_targets;  // [capacity]
};

// Buffers depend on the model's H and split count, so they grow at Stage
// when a wider model arrives.
class VocabParallelExecutor final : public LogpExecutor {
 public:
  explicit VocabParallelExecutor(int64_t capacity)
      : capacity_(capacity + capacity % 2), layout_{capacity_} {}

  ~VocabParallelExecutor() override {
    for (auto& lane : lanes_) {
      if (lane->stream != nullptr) cudaStreamDestroy(lane->stream);
    }
  }

  absl::Status Init(const std::vector<int>& devices) {
    if (absl::Status s =
            host_outputs_.Allocate(layout_.output_bytes(), "cudaHostAlloc");
        !s.ok()) {
      return s;
    }
    for (int device : devices) {
      lanes_.push_back(std::make_unique<ShardLane>());
      ShardLane& lane = *lanes_.back();
      lane.device = device;
      DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "cudaSetDevice");
      DETLOGP_RETURN_IF_CUDA_ERROR(
          cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking),
          "cudaStreamCreate");
      if (absl::Status s =
              lane.z.Allocate(capacity_ * sizeof(float), "cudaMalloc");
          !s.ok()) {
        return s;
      }
      for (auto [buffer, bytes] :
           {std::pair{&lane.host_z, capacity_ * sizeof(float)},
            {&lane.host_local_targets, capacity_ * sizeof(int32_t)}}) {
        if (absl::Status s = buffer->Allocate(bytes, "cudaHostAlloc"); !s.ok())
          return s;
      }
    }
    // The combine runs on the first GPU.
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(lanes_[0]->device),
                                 "cudaSetDevice");
    return combine_outputs_.Allocate(layout_.output_bytes(), "cudaMalloc");
  }

  absl::StatusOr<LogpStaging> Stage(const LogpModel& model) override {
    const auto& shards = static_cast<const CudaModel&>(model).heads();
    if (shards.size() != lanes_.size()) {
      return absl::InternalError("model has a shard count the executor lacks");
    }
    hidden_size_ = model.hidden_size();
    total_splits_ = kernels::NumVocabSplits(model.vocab_size());
    const size_t input_bytes = layout_.input_bytes(hidden_size_);
    if (absl::Status s = host_inputs_.Reserve(input_bytes, "cudaHostAlloc");
        !s.ok())
      return s;
    for (auto& lane : lanes_) {
      DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(lane->device),
                                   "cudaSetDevice");
      if (absl::Status s = lane->inputs.Reserve(input_bytes, "cudaMalloc");
          !s.ok())
        return s;
    }
    if (absl::Status s = ReservePartials(shards, LogpExtras{}); !s.ok())
      return s;
    return layout_.View(host_inputs_.as<void>(), host_outputs_.as<void>());
  }

  absl::Status Run(const LogpModel& model, int64_t rows,
                   const LogpExtras& extras) override {
    if (rows > capacity_ || model.hidden_size() != hidden_size_) {
      return absl::InternalError("batch does not match the executor's staging");
    }
    if (rows == 0) return absl::OkStatus();
    const auto& shards = static_cast<const CudaModel&>(model).heads();
    // The extras' partials are larger; buffers grow on first use.
    if (absl::Status s = ReservePartials(shards, extras); !s.ok()) return s;
    const LogpStaging host =
        layout_.View(host_inputs_.as<void>(), host_outputs_.as<void>());
    // 1. Every shard computes its splits; they run concurrently.
    for (size_t g = 0; g < lanes_.size(); ++g) {
      if (absl::Status s =
              LaunchShard(*lanes_[g], *shards[g], host, rows, extras);
          !s.ok()) {
        SyncAll().IgnoreError();  // reporting the launch failure, not the sync
        return s;
      }
    }
    absl::Status synced = SyncAll();
    if (!synced.ok()) return synced;
    // 2. z[target] comes from the shard holding the target (a copy, no
    // arithmetic); the partials already sit in split order.
    float* z = host.logprobs;
    for (int64_t r = 0; r < rows; ++r) {
      for (size_t g = 0; g < lanes_.size(); ++g) {
        if (host.targets[r] >= shards[g]->first_row &&
            host.targets[r] < shards[g]->end_row) {
          z[r] = lanes_[g]->host_z.as<float>()[r];
        }
      }
    }
    // 3. The single-GPU fold, on the first shard's GPU.
    const ShardLane& first = *lanes_[0];
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(first.device), "cudaSetDevice");
    const LogpStaging device =
        layout_.View(nullptr, combine_outputs_.as<void>());
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(combine_partials_.as<void>(), host_partials_.as<void>(),
                        PartialsBytes(rows, total_splits_, extras),
                        cudaMemcpyHostToDevice, first.stream),
        "copy partials to the combining GPU");
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(device.logprobs, z, rows * sizeof(float),
                        cudaMemcpyHostToDevice, first.stream),
        "copy z[target] to the combining GPU");
    LinearLogpBatchView outputs;
    outputs.rows = rows;
    outputs.logprobs = device.logprobs;
    outputs.lse = device.lse;
    outputs.entropy = extras.entropy ? device.entropy : nullptr;
    outputs.top_k = extras.top_k;
    outputs.top_ids = device.top_ids;
    outputs.top_logprobs = device.top_logprobs;
    absl::Status combined = LinearLogpCuda::LaunchCombine(
        Partition(combine_partials_.as<void>(), rows, total_splits_, extras),
        total_splits_, outputs, first.device, first.stream,
        shards[0]->kernel->options().kernel);
    if (combined.ok()) {
      combined = CopyOutputsToHost(layout_, device, host_outputs_.as<void>(),
                                   rows, extras, first.stream);
    }
    const absl::Status synced_combine =
        CudaStatus(cudaStreamSynchronize(first.stream), "combine on the GPU");
    return combined.ok() ? synced_combine : combined;
  }

 private:
  // Grows the shards' partials, the host gather and the combining GPU's copy
  // to `extras`' size for a full batch.
  absl::Status ReservePartials(
      const std::vector<std::unique_ptr<CudaLmHead>>& shards,
      const LogpExtras& extras) {
    for (size_t g = 0; g < lanes_.size(); ++g) {
      DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(lanes_[g]->device),
                                   "cudaSetDevice");
      const int32_t splits = shards[g]->end_split - shards[g]->first_split;
      if (absl::Status s = lanes_[g]->partials.Reserve(
              PartialsBytes(capacity_, splits, extras), "cudaMalloc");
          !s.ok()) {
        return s;
      }
    }
    const size_t bytes = PartialsBytes(capacity_, total_splits_, extras);
    if (absl::Status s = host_partials_.Reserve(bytes, "cudaHostAlloc");
        !s.ok())
      return s;
    DETLOGP_RETURN_IF_CUDA_ERROR(cudaSetDevice(lanes_[0]->device),
                                 "cudaSetDevice");
    return combine_partials_.Reserve(bytes, "cudaMalloc");
  }

  absl::Status LaunchShard(ShardLane& lane, const CudaLmHead& shard,
                           const LogpStaging& host, int64_t rows,
                           const LogpExtras& extras) {
    int32_t* local_targets = lane.host_local_targets.as<int32_t>();
    for (int64_t r = 0; r < rows; ++r) {
      local_targets[r] =
          static_cast<int32_t>(host.targets[r] - shard.first_row);
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
                        rows * sizeof(float), cudaMemcpyHostToDevice,
                        lane.stream),
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
    batch.top_k = extras.top_k;
    const int32_t splits = shard.end_split - shard.first_split;
    const SplitPartials local =
        Partition(lane.partials.as<void>(), rows, splits, extras);
    if (absl::Status s = shard.kernel->LaunchSplits(batch, local, lane.stream);
        !s.ok()) {
      return s;
    }
    // The shard's [rows][splits] blocks land in columns [first, end) of the
    // host's [rows][total_splits] tables (the top lists top_k wide per
    // split): ascending split order, global token ids.
    const SplitPartials all =
        Partition(host_partials_.as<void>(), rows, total_splits_, extras);
    auto gather = [&](void* to, const void* from, size_t cell_bytes) {
      return CudaStatus(
          cudaMemcpy2DAsync(
              static_cast<char*>(to) + shard.first_split * cell_bytes,
              total_splits_ * cell_bytes, from, splits * cell_bytes,
              splits * cell_bytes, rows, cudaMemcpyDeviceToHost, lane.stream),
          "copy partials from a shard");
    };
    const size_t top_bytes = extras.top_k * sizeof(float);
    for (auto [to, from, cell_bytes] :
         {std::tuple<void*, const void*, size_t>{all.lse, local.lse,
                                                 sizeof(float)},
          {all.mean_z, local.mean_z, sizeof(float)},
          {all.top_z, local.top_z, top_bytes},
          {all.top_ids, local.top_ids, top_bytes}}) {
      if (from == nullptr) continue;  // not asked for
      if (absl::Status s = gather(to, from, cell_bytes); !s.ok()) return s;
    }
    DETLOGP_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(lane.host_z.as<void>(), lane.z.as<void>(),
                        rows * sizeof(float), cudaMemcpyDeviceToHost,
                        lane.stream),
        "copy z from a shard");
    return absl::OkStatus();
  }

  absl::Status SyncAll() {
    absl::Status first_error;
    for (auto& lane : lanes_) {
      cudaSetDevice(lane->device);
      absl::Status s =
          CudaStatus(cudaStreamSynchronize(lane->stream), "shard on the GPU");
      if (first_error.ok()) first_error = s;
    }
    return first_error;
  }

  const int64_t capacity_;
  int64_t hidden_size_ = 0;  // of the model last staged
  int32_t total_splits_ = 0;
  const BatchLayout layout_;
  PinnedBuffer host_inputs_, host_outputs_, host_partials_;
  DeviceBuffer combine_partials_, combine_outputs_;
  std::vector<std::unique_ptr<ShardLane>> lanes_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<CudaLmHead>>> UploadVocabShards(
    const LmHeadWeights& weights, const std::vector<int>& devices,
    kernels::cuda::KernelKind kernel) {
  const int32_t splits = kernels::NumVocabSplits(weights.vocab_size);
  const int shards = static_cast<int>(devices.size());
  if (shards < 1 || shards > splits) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocabulary parallelism over ", shards, " GPUs needs 1..",
                     splits, " of them"));
  }
  std::vector<std::unique_ptr<CudaLmHead>> out;
  for (int g = 0; g < shards; ++g) {
    auto shard = UploadLmHead(weights, devices[g], kernel, splits * g / shards,
                              splits * (g + 1) / shards);
    if (!shard.ok()) return shard.status();
    out.push_back(*std::move(shard));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<LogpExecutor>> NewVocabParallelExecutor(
    const std::vector<int>& devices, int64_t capacity) {
  if (devices.empty()) return absl::InvalidArgumentError("no devices");
  auto executor = std::make_unique<VocabParallelExecutor>(capacity);
  if (absl::Status s = executor->Init(devices); !s.ok()) return s;
  return std::unique_ptr<LogpExecutor>(std::move(executor));
}

}  // namespace detlogp::server
