// Bearer-token authentication for detlogp's own services. Tokens come from a
// file (one per line; blank lines and '#' comments ignored), never from argv.
// The health service stays open for probes.
#ifndef DETLOGP_SERVER_TRANSPORT_AUTH_H_
#define DETLOGP_SERVER_TRANSPORT_AUTH_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/server_context.h>

#include "absl/status/statusor.h"

namespace detlogp::server {

class TokenAuthenticator {
 public:
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> FromFile(
      const std::string& path);
  static std::unique_ptr<TokenAuthenticator> FromTokens(
      std::vector<std::string> tokens);

  // OK when the call carries "authorization: Bearer <a known token>",
  // UNAUTHENTICATED otherwise. Comparisons take the same time for every
  // candidate, so timing does not leak how much of a token matched.
  absl::Status Check(const grpc::CallbackServerContext& context) const;

  // The bearer token the call presented ("" without one): whose
  // shared-memory regions the call may use once Check passed.
  static std::string PresentedToken(const grpc::CallbackServerContext& context);

 private:
  explicit TokenAuthenticator(std::vector<std::string> tokens)
      : tokens_(std::move(tokens)) {}
  std::vector<std::string> tokens_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_AUTH_H_
