#include "client/push_targets.h"

#include <optional>
#include <set>

#include "absl/strings/str_cat.h"

namespace detlogp::client {

absl::StatusOr<std::vector<PushTarget>> ExpandPushTargets(
    const std::vector<std::string>& targets, const TargetResolver& resolver) {
  const TargetResolver& resolve = resolver ? resolver : ResolveInPodOrder;
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
  // A name's address is checked against the name's certificate.
  return MakeChannel(one, target.tls_name);
}

}  // namespace detlogp::client
