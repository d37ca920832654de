#include "server/transport/shared_memory_service.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/transport/grpc_status.h"
#include "server/transport/local_peer.h"
#include "proto/status_details.h"

namespace detlogp::server {

SharedMemoryServiceImpl::SharedMemoryServiceImpl(const Options& options,
                                                 SharedMemoryRegistry* registry)
    : options_(options), registry_(registry) {}

absl::Status SharedMemoryServiceImpl::Admit(
    const grpc::CallbackServerContext& context) const {
  if (options_.authenticator != nullptr) {
    if (absl::Status s = options_.authenticator->Check(context); !s.ok())
      return s;
  }
  if (!options_.enabled) {
    return v1::WithReason(
        absl::FailedPreconditionError(
            "shared memory is off on this server (--allow_shared_memory); "
            "send the bytes in the request"),
        v1::kReasonRegionRefused);
  }
  const std::string peer = context.peer();
  const bool local = options_.is_same_host ? options_.is_same_host(peer)
                                           : IsSameHostPeer(peer);
  if (!local) {
    return v1::WithReason(
        absl::PermissionDeniedError(absl::StrCat(
            "shared memory: the caller (", peer,
            ") is not on the server's host; only the Unix socket and "
            "loopback callers may use it")),
        v1::kReasonRegionRefused);
  }
  return absl::OkStatus();
}

void SharedMemoryServiceImpl::Finish(grpc::ServerUnaryReactor* reactor,
                                     absl::string_view method,
                                     const absl::Status& status) const {
  const grpc::Status grpc_status = ToGrpcStatus(status);
  if (options_.on_call_done) {
    options_.on_call_done(method, grpc_status.error_code());
  }
  reactor->Finish(grpc_status);
}

detlogp::v1::SharedMemoryLimits SharedMemoryServiceImpl::Limits() const {
  const SharedMemoryRegistry::Totals totals = registry_->totals();
  detlogp::v1::SharedMemoryLimits limits;
  limits.set_max_bytes(registry_->options().max_bytes);
  limits.set_registered_bytes(totals.system_bytes + totals.cuda_bytes);
  limits.set_idle_release_s(
      absl::ToInt64Seconds(registry_->options().idle_release));
  return limits;
}

void SharedMemoryServiceImpl::FillUse(const SharedMemoryRegistry::Use& use,
                                      detlogp::v1::SharedMemoryUse* out) const {
  out->set_requests_in_flight(use.requests_in_flight);
  out->set_requests(use.requests);
  out->set_bytes_read(use.bytes_read);
  out->set_last_use_unix_us(absl::ToUnixMicros(use.last_use));
  const absl::Duration idle = registry_->options().idle_release;
  if (idle > absl::ZeroDuration()) {
    const absl::Duration left =
        std::max(absl::ZeroDuration(), use.last_use + idle - absl::Now());
    out->set_idle_release_in_s(
        absl::ToInt64Seconds(absl::Ceil(left, absl::Seconds(1))));
  }
}

// ---------------------------------------------------------------- system

grpc::ServerUnaryReactor* SharedMemoryServiceImpl::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* context,
    const detlogp::v1::SystemSharedMemoryRegisterRequest* request,
    detlogp::v1::SystemSharedMemoryRegisterResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  constexpr absl::string_view kMethod = "SystemSharedMemoryRegister";
  if (absl::Status s = Admit(*context); !s.ok()) {
    Finish(reactor, kMethod, s);
    return reactor;
  }
  std::string owner = TokenAuthenticator::PresentedToken(*context);
  // gRPC keeps *request alive until the reactor finishes.
  registrations_.Start([this, reactor, request, owner = std::move(owner),
                        kMethod] {
    Finish(reactor, kMethod,
           registry_->RegisterSystem(owner, request->name(), request->key(),
                                     request->offset(), request->byte_size()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* SharedMemoryServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context,
    const detlogp::v1::SystemSharedMemoryStatusRequest* request,
    detlogp::v1::SystemSharedMemoryStatusResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  constexpr absl::string_view kMethod = "SystemSharedMemoryStatus";
  if (absl::Status s = Admit(*context); !s.ok()) {
    Finish(reactor, kMethod, s);
    return reactor;
  }
  auto listed = registry_->List(TokenAuthenticator::PresentedToken(*context),
                                RegionKind::kSystem, request->name());
  if (listed.ok()) {
    for (const SharedMemoryRegistry::RegionStatus& region : *listed) {
      auto* out = response->add_regions();
      out->set_name(region.name);
      out->set_key(region.key);
      out->set_offset(region.offset);
      out->set_byte_size(region.byte_size);
      FillUse(region.use, out->mutable_use());
    }
    *response->mutable_limits() = Limits();
  }
  Finish(reactor, kMethod, listed.status());
  return reactor;
}

grpc::ServerUnaryReactor* SharedMemoryServiceImpl::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const detlogp::v1::SystemSharedMemoryUnregisterRequest* request,
    detlogp::v1::SystemSharedMemoryUnregisterResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  constexpr absl::string_view kMethod = "SystemSharedMemoryUnregister";
  absl::Status status = Admit(*context);
  if (status.ok()) {
    status = registry_->Unregister(TokenAuthenticator::PresentedToken(*context),
                                   RegionKind::kSystem, request->name());
  }
  Finish(reactor, kMethod, status);
  return reactor;
}

// ---------------------------------------------------------------- CUDA

grpc::ServerUnaryReactor* SharedMemoryServiceImpl::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* context,
    const detlogp::v1::CudaSharedMemoryRegisterRequest* request,
    detlogp::v1::CudaSharedMemoryRegisterResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  constexpr absl::string_view kMethod = "CudaSharedMemoryRegister";
  if (absl::Status s = Admit(*context); !s.ok()) {
    Finish(reactor, kMethod, s);
    return reactor;
  }
  std::string owner = TokenAuthenticator::PresentedToken(*context);
  registrations_.Start([this, reactor, request, owner = std::move(owner),
                        kMethod] {
    Finish(
        reactor, kMethod,
        registry_->RegisterCuda(owner, request->name(), request->raw_handle(),
                                request->device_id(), request->byte_size()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* SharedMemoryServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* context,
    const detlogp::v1::CudaSharedMemoryStatusRequest* request,
    detlogp::v1::CudaSharedMemoryStatusResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  constexpr absl::string_view kMethod = "CudaSharedMemoryStatus";
  if (absl::Status s = Admit(*context); !s.ok()) {
    Finish(reactor, kMethod, s);
    return reactor;
  }
  auto listed = registry_->List(TokenAuthenticator::PresentedToken(*context),
                                RegionKind::kCuda, request->name());
  if (listed.ok()) {
    for (const SharedMemoryRegistry::RegionStatus& region : *listed) {
      auto* out = response->add_regions();
      out->set_name(region.name);
      out->set_device_id(region.device);
      out->set_byte_size(region.byte_size);
      FillUse(region.use, out->mutable_use());
    }
    *response->mutable_limits() = Limits();
  }
  Finish(reactor, kMethod, listed.status());
  return reactor;
}

grpc::ServerUnaryReactor* SharedMemoryServiceImpl::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const detlogp::v1::CudaSharedMemoryUnregisterRequest* request,
    detlogp::v1::CudaSharedMemoryUnregisterResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  constexpr absl::string_view kMethod = "CudaSharedMemoryUnregister";
  absl::Status status = Admit(*context);
  if (status.ok()) {
    status = registry_->Unregister(TokenAuthenticator::PresentedToken(*context),
                                   RegionKind::kCuda, request->name());
  }
  Finish(reactor, kMethod, status);
  return reactor;
}

}  // namespace detlogp::server
