#include "client/region_api.h"

#include <utility>

#include "absl/time/clock.h"
#include "client/score_result.h"

namespace detlogp::client {

RegionApi::RegionApi(std::shared_ptr<grpc::Channel> channel,
                     std::function<void(grpc::ClientContext*)> prepare)
    : stub_(detlogp::v1::SharedMemoryService::NewStub(std::move(channel))),
      prepare_(std::move(prepare)) {}

std::unique_ptr<grpc::ClientContext> RegionApi::Context(
    absl::Duration timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  prepare_(context.get());
  if (timeout != absl::InfiniteDuration()) {
    const absl::Time sooner = absl::Now() + timeout;
    if (absl::FromChrono(context->deadline()) > sooner) {
      context->set_deadline(absl::ToChronoTime(sooner));
    }
  }
  return context;
}

absl::Status RegionApi::RegisterSystem(const std::string& name,
                                       const std::string& key, int64_t offset,
                                       int64_t byte_size) {
  detlogp::v1::SystemSharedMemoryRegisterRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  detlogp::v1::SystemSharedMemoryRegisterResponse response;
  return FromGrpcStatus(
      stub_->SystemSharedMemoryRegister(Context().get(), request, &response));
}

absl::Status RegionApi::RegisterCuda(const std::string& name,
                                     const std::string& raw_handle,
                                     int64_t device_id, int64_t byte_size) {
  detlogp::v1::CudaSharedMemoryRegisterRequest request;
  request.set_name(name);
  request.set_raw_handle(raw_handle);
  request.set_device_id(device_id);
  request.set_byte_size(byte_size);
  detlogp::v1::CudaSharedMemoryRegisterResponse response;
  return FromGrpcStatus(
      stub_->CudaSharedMemoryRegister(Context().get(), request, &response));
}

absl::Status RegionApi::UnregisterSystem(const std::string& name,
                                         absl::Duration timeout) {
  detlogp::v1::SystemSharedMemoryUnregisterRequest request;
  request.set_name(name);
  detlogp::v1::SystemSharedMemoryUnregisterResponse response;
  return FromGrpcStatus(stub_->SystemSharedMemoryUnregister(
      Context(timeout).get(), request, &response));
}

absl::Status RegionApi::UnregisterCuda(const std::string& name,
                                       absl::Duration timeout) {
  detlogp::v1::CudaSharedMemoryUnregisterRequest request;
  request.set_name(name);
  detlogp::v1::CudaSharedMemoryUnregisterResponse response;
  return FromGrpcStatus(stub_->CudaSharedMemoryUnregister(
      Context(timeout).get(), request, &response));
}

absl::StatusOr<detlogp::v1::SystemSharedMemoryStatusResponse>
RegionApi::SystemStatus(const std::string& name) {
  detlogp::v1::SystemSharedMemoryStatusRequest request;
  request.set_name(name);
  detlogp::v1::SystemSharedMemoryStatusResponse response;
  const grpc::Status status =
      stub_->SystemSharedMemoryStatus(Context().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<detlogp::v1::CudaSharedMemoryStatusResponse>
RegionApi::CudaStatus(const std::string& name) {
  detlogp::v1::CudaSharedMemoryStatusRequest request;
  request.set_name(name);
  detlogp::v1::CudaSharedMemoryStatusResponse response;
  const grpc::Status status =
      stub_->CudaSharedMemoryStatus(Context().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

}  // namespace detlogp::client
