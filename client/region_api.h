// SharedMemoryService as the clients call it: registering, listing and
// unregistering the system and CUDA regions that requests name
// (docs/shared_memory.md). The server checks every field and names the one
// it refuses; a region belongs to the bearer token that registered it.
#ifndef DETLOGP_CLIENT_REGION_API_H_
#define DETLOGP_CLIENT_REGION_API_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "detlogp/v1/detlogp.grpc.pb.h"

namespace detlogp::client {

class RegionApi {
 public:
  // `prepare` sets a call's deadline and credentials.
  RegionApi(std::shared_ptr<grpc::Channel> channel,
            std::function<void(grpc::ClientContext*)> prepare);

  // Bytes [offset, offset + byte_size) of the POSIX shared-memory object
  // `key` (shm_open's name) as region `name`.
  absl::Status RegisterSystem(const std::string& name, const std::string& key,
                              int64_t offset, int64_t byte_size);
  // `byte_size` bytes from the base of the allocation `raw_handle` (the 64
  // bytes of its cudaIpcMemHandle_t) names, on CUDA device `device_id` as
  // the server numbers its GPUs.
  absl::Status RegisterCuda(const std::string& name,
                            const std::string& raw_handle, int64_t device_id,
                            int64_t byte_size);
  // `name` empty: every region of that kind the caller may use.
  absl::Status UnregisterSystem(
      const std::string& name,
      absl::Duration timeout = absl::InfiniteDuration());
  absl::Status UnregisterCuda(
      const std::string& name,
      absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<detlogp::v1::SystemSharedMemoryStatusResponse> SystemStatus(
      const std::string& name);
  absl::StatusOr<detlogp::v1::CudaSharedMemoryStatusResponse> CudaStatus(
      const std::string& name);

 private:
  // A context for one call, ending within `timeout` when that is sooner.
  std::unique_ptr<grpc::ClientContext> Context(
      absl::Duration timeout = absl::InfiniteDuration()) const;

  std::unique_ptr<detlogp::v1::SharedMemoryService::Stub> stub_;
  std::function<void(grpc::ClientContext*)> prepare_;
};

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_REGION_API_H_
