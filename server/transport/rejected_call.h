// A streaming reactor that ends its call at once with a status (used when a
// call is refused before any work, e.g. authentication failed).
#ifndef DETLOGP_SERVER_TRANSPORT_REJECTED_CALL_H_
#define DETLOGP_SERVER_TRANSPORT_REJECTED_CALL_H_

#include <grpcpp/support/server_callback.h>

namespace detlogp::server {

// `Reactor` is a grpc::ServerBidiReactor<...> or grpc::ServerWriteReactor<...>.
template <typename Reactor>
class RejectedCall final : public Reactor {
 public:
  explicit RejectedCall(const grpc::Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_REJECTED_CALL_H_
