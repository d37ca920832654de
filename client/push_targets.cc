#include "client/push_targets.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "client/grpc_lifetime.h"

namespace detlogp::client {

absl::StatusOr<std::vector<PushTarget>> ExpandPushTargets(
    const std::vector<std::string>& targets, const TargetResolver& resolver) {
  const TargetResolver& resolve = resolver ? resolver : ResolveWithGetaddrinfo;
  std::vector<PushTarget> out;
  std::set<std::string> seen;
  auto add = [&](PushTarget target) {
    if (seen.insert(target.target).second) out.push_back(std::move(target));
  };
  for (const std::string& target : targets) {
    absl::StatusOr<std::optional<DnsName>> name = ParseDnsTarget(target);
    if (!name.ok()) return name.status();
    if (!name->has_value()) {
      add({target, "", ""});
      continue;
    }
    absl::StatusOr<std::vector<std::string>> addresses =
        resolve((*name)->host, (*name)->port);
    if (!addresses.ok() || addresses->empty()) {
      return absl::UnavailableError(absl::StrCat(
          "push: ", target, " resolves to no server (",
          addresses.ok() ? "no address" : addresses.status().message(), ")"));
    }
    for (std::string& address : *addresses) {
      add({std::move(address), target, (*name)->host});
    }
  }
  return out;
}

std::shared_ptr<grpc::Channel> MakePushChannel(
    const LogpClient::Options& connection, const PushTarget& target) {
  LogpClient::Options one = connection;
  one.target = target.target;
  one.own_connection = true;
  if (target.tls_name.empty() || connection.tls_root_certs.empty()) {
    return MakeChannel(one);
  }
  // MakeChannel's channel, and the name's certificate checked at the
  // address (as the scoring client checks its replicas').
  KeepGrpcInitialized();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(connection.max_message_bytes);
  args.SetMaxSendMessageSize(connection.max_message_bytes);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetSslTargetNameOverride(target.tls_name);
  for (const auto& [key, value] : connection.int_channel_args) {
    args.SetInt(key, value);
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = connection.tls_root_certs;
  ssl.pem_cert_chain = connection.tls_client_cert;
  ssl.pem_private_key = connection.tls_client_key;
  return grpc::CreateCustomChannel(target.target, grpc::SslCredentials(ssl),
                                   args);
}

}  // namespace detlogp::client
