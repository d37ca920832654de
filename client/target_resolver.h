// "dns:" targets as the client's replicas: the name a target holds, and the
// addresses it resolves to (every A and AAAA record), one replica each.
//
//   auto name = ParseDnsTarget("dns:///detlogp.ns.svc:50051");
//   // name->host "detlogp.ns.svc", name->port "50051"
//   auto addresses = ResolveWithGetaddrinfo(name->host, name->port);
//   // {"10.0.0.7:50051", "10.0.0.9:50051", "[fd00::3]:50051"}
//
// A Kubernetes StatefulSet's headless Service answers one record per ready
// pod, so re-resolving the name follows pods as they come and go.
#ifndef DETLOGP_CLIENT_TARGET_RESOLVER_H_
#define DETLOGP_CLIENT_TARGET_RESOLVER_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace detlogp::client {

// A target's name and port.
struct DnsName {
  std::string host;
  std::string port;
};

// The name of a "dns:" target ("dns:///host:port", "dns:host:port" or
// "dns://authority/host:port"; IPv6 literals in brackets); nullopt for a
// target of another scheme; INVALID_ARGUMENT for a "dns:" target without a
// host or port.
absl::StatusOr<std::optional<DnsName>> ParseDnsTarget(absl::string_view target);

// Resolves a name to gRPC targets of single addresses ("ip:port",
// "[ipv6]:port"), sorted, without duplicates. The client's default resolver
// is ResolveWithGetaddrinfo; tests inject their own.
using TargetResolver = std::function<absl::StatusOr<std::vector<std::string>>(
    const std::string& host, const std::string& port)>;

// Every A and AAAA record of `host` (getaddrinfo); UNAVAILABLE naming the
// host when it resolves to none.
absl::StatusOr<std::vector<std::string>> ResolveWithGetaddrinfo(
    const std::string& host, const std::string& port);

// The host name an address ("ip:port", "[ipv6]:port") has in reverse DNS;
// empty when it has none. Tests inject their own.
using ReverseResolver = std::function<std::string(const std::string& address)>;

// getnameinfo's name for the address (NI_NAMEREQD); empty when none.
std::string ReverseResolveWithGetnameinfo(const std::string& address);

// `addresses` in pod-ordinal order when every one's reverse name starts
// with "<set>-<ordinal>." for one <set>, as a Kubernetes StatefulSet's pods
// behind a headless Service do ("detlogp-2.detlogp.ns.svc.cluster.local");
// otherwise unchanged. A chain through a StatefulSet then runs pod 0, 1, 2,
// ... whatever addresses the pods have.
std::vector<std::string> InPodOrdinalOrder(std::vector<std::string> addresses,
                                           const ReverseResolver& reverse);

// `reverse` of every address, side by side; when any lookup has not
// answered within `budget`, every name is "" (a resolver that does not
// answer cannot hold a push up for long; its lookups finish on their own).
std::vector<std::string> ReverseNamesWithin(
    const std::vector<std::string>& addresses, const ReverseResolver& reverse,
    absl::Duration budget);

// ResolveWithGetaddrinfo, then InPodOrdinalOrder with the names
// ReverseNamesWithin finds in 2 s: the servers a push reaches through a
// "dns:" name, in the order it chains them.
absl::StatusOr<std::vector<std::string>> ResolveInPodOrder(
    const std::string& host, const std::string& port);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_TARGET_RESOLVER_H_
