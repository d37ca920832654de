#include "client/target_resolver.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace detlogp::client {

absl::StatusOr<std::optional<DnsName>> ParseDnsTarget(
    absl::string_view target) {
  absl::string_view rest = target;
  if (!absl::ConsumePrefix(&rest, "dns:")) return std::nullopt;
  // "dns://authority/host:port": the authority names a DNS server; the
  // system's resolver is used whatever it says.
  if (absl::ConsumePrefix(&rest, "//")) {
    const size_t slash = rest.find('/');
    if (slash == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target: ", target, " has no host:port after dns://authority/"));
    }
    rest.remove_prefix(slash + 1);
  }
  DnsName name;
  size_t colon;
  if (absl::StartsWith(rest, "[")) {
    const size_t close = rest.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("target: ", target, " has an unclosed [ipv6] host"));
    }
    name.host = std::string(rest.substr(1, close - 1));
    colon = close + 1;
    if (colon >= rest.size() || rest[colon] != ':') colon = rest.size();
  } else {
    colon = rest.rfind(':');
    if (colon == absl::string_view::npos) colon = rest.size();
    name.host = std::string(rest.substr(0, colon));
  }
  if (colon + 1 < rest.size()) name.port = std::string(rest.substr(colon + 1));
  if (name.host.empty() || name.port.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target: ", target, " needs a host and a port (dns:///host:port)"));
  }
  return name;
}

absl::StatusOr<std::vector<std::string>> ResolveWithGetaddrinfo(
    const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (error != 0) {
    return absl::UnavailableError(
        absl::StrCat("target: ", host, ":", port,
                     " did not resolve: ", gai_strerror(error)));
  }
  std::vector<std::string> targets;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      targets.push_back(absl::StrCat(text, ":", port));
    } else if (a->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
      targets.push_back(absl::StrCat("[", text, "]:", port));
    }
  }
  freeaddrinfo(found);
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  if (targets.empty()) {
    return absl::UnavailableError(
        absl::StrCat("target: ", host, ":", port, " has no address"));
  }
  return targets;
}

}  // namespace detlogp::client
