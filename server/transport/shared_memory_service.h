// SharedMemoryService over gRPC's callback API: registration, status and
// release of the shared-memory regions requests may name instead of sending
// their bytes (server/shared_memory/region_registry.h holds them).
//
// Every call is refused with FAILED_PRECONDITION when the server runs
// without --allow_shared_memory, and with PERMISSION_DENIED from a caller
// that is not on the server's host (neither the Unix socket nor a loopback
// address). With bearer tokens, a call sees only its token's regions.
// Registration maps or opens memory (and may pin it), which takes time: it
// runs on a thread of its own, never on gRPC's.
#ifndef DETLOGP_SERVER_TRANSPORT_SHARED_MEMORY_SERVICE_H_
#define DETLOGP_SERVER_TRANSPORT_SHARED_MEMORY_SERVICE_H_

#include <functional>

#include "absl/strings/string_view.h"
#include "detlogp/v1/detlogp.grpc.pb.h"
#include "server/shared_memory/region_registry.h"
#include "server/transport/auth.h"
#include "server/transport/background_tasks.h"

namespace detlogp::server {

class SharedMemoryServiceImpl final
    : public detlogp::v1::SharedMemoryService::CallbackService {
 public:
  struct Options {
    // --allow_shared_memory.
    bool enabled = false;
    // When set, every call must carry a known bearer token.
    const TokenAuthenticator* authenticator = nullptr;
    // Decides whether a peer string is on this host (tests replace it).
    std::function<bool(absl::string_view peer)> is_same_host;
    // Called once per finished call with the method name and gRPC code.
    std::function<void(absl::string_view method, int grpc_code)> on_call_done;
  };

  // `registry` outlives the service.
  SharedMemoryServiceImpl(const Options& options,
                          SharedMemoryRegistry* registry);

  bool enabled() const { return options_.enabled; }

  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const detlogp::v1::SystemSharedMemoryRegisterRequest* request,
      detlogp::v1::SystemSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const detlogp::v1::SystemSharedMemoryStatusRequest* request,
      detlogp::v1::SystemSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const detlogp::v1::SystemSharedMemoryUnregisterRequest* request,
      detlogp::v1::SystemSharedMemoryUnregisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const detlogp::v1::CudaSharedMemoryRegisterRequest* request,
      detlogp::v1::CudaSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const detlogp::v1::CudaSharedMemoryStatusRequest* request,
      detlogp::v1::CudaSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const detlogp::v1::CudaSharedMemoryUnregisterRequest* request,
      detlogp::v1::CudaSharedMemoryUnregisterResponse* response) override;

 private:
  // OK, or why the call is refused (token, flag, peer).
  absl::Status Admit(const grpc::CallbackServerContext& context) const;
  // Finishes `reactor` with `status` and records it.
  void Finish(grpc::ServerUnaryReactor* reactor, absl::string_view method,
              const absl::Status& status) const;
  detlogp::v1::SharedMemoryLimits Limits() const;
  void FillUse(const SharedMemoryRegistry::Use& use,
               detlogp::v1::SharedMemoryUse* out) const;

  const Options options_;
  SharedMemoryRegistry* const registry_;
  // Last member: joined first, while the rest is still alive.
  BackgroundTasks registrations_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_SHARED_MEMORY_SERVICE_H_
