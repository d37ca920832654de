#include "client/target_resolver.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

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

std::string ReverseResolveWithGetnameinfo(const std::string& address) {
  // "ip:port" or "[ipv6]:port": the address without its port.
  std::string ip = address.substr(0, address.rfind(':'));
  if (absl::StartsWith(ip, "[") && absl::EndsWith(ip, "]")) {
    ip = ip.substr(1, ip.size() - 2);
  }
  sockaddr_storage storage{};
  socklen_t length = 0;
  auto* in = reinterpret_cast<sockaddr_in*>(&storage);
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, ip.c_str(), &in->sin_addr) == 1) {
    in->sin_family = AF_INET;
    length = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, ip.c_str(), &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    length = sizeof(sockaddr_in6);
  } else {
    return "";
  }
  char name[NI_MAXHOST] = {};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&storage), length, name,
                  sizeof(name), nullptr, 0, NI_NAMEREQD) != 0) {
    return "";
  }
  return name;
}

std::vector<std::string> InPodOrdinalOrder(std::vector<std::string> addresses,
                                           const ReverseResolver& reverse) {
  if (addresses.size() < 2 || !reverse) return addresses;
  std::string set;
  std::vector<std::pair<int64_t, std::string>> by_ordinal;
  for (const std::string& address : addresses) {
    const std::string name = reverse(address);
    const absl::string_view label =
        absl::string_view(name).substr(0, name.find('.'));
    const size_t dash = label.rfind('-');
    int64_t ordinal = 0;
    if (dash == absl::string_view::npos || dash == 0 ||
        dash + 1 == label.size() ||
        !std::all_of(label.begin() + dash + 1, label.end(),
                     absl::ascii_isdigit) ||
        !absl::SimpleAtoi(label.substr(dash + 1), &ordinal)) {
      return addresses;  // not a StatefulSet's pod
    }
    const absl::string_view prefix = label.substr(0, dash);
    if (by_ordinal.empty()) {
      set = std::string(prefix);
    } else if (prefix != set) {
      return addresses;  // pods of different sets: no one order
    }
    by_ordinal.emplace_back(ordinal, address);
  }
  std::sort(by_ordinal.begin(), by_ordinal.end());
  for (size_t i = 1; i < by_ordinal.size(); ++i) {
    if (by_ordinal[i].first == by_ordinal[i - 1].first) return addresses;
  }
  for (size_t i = 0; i < by_ordinal.size(); ++i) {
    addresses[i] = std::move(by_ordinal[i].second);
  }
  return addresses;
}

std::vector<std::string> ReverseNamesWithin(
    const std::vector<std::string>& addresses, const ReverseResolver& reverse,
    absl::Duration budget) {
  // Shared with the lookups, which may outlive this call.
  struct Lookups {
    bool AllAnswered() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return answered == names.size();
    }
    absl::Mutex mu;
    std::vector<std::string> names ABSL_GUARDED_BY(mu);
    size_t answered ABSL_GUARDED_BY(mu) = 0;
  };
  auto lookups = std::make_shared<Lookups>();
  {
    absl::MutexLock lock(&lookups->mu);
    lookups->names.resize(addresses.size());
  }
  for (size_t i = 0; i < addresses.size(); ++i) {
    std::thread([lookups, i, reverse, address = addresses[i]] {
      std::string name = reverse(address);
      absl::MutexLock lock(&lookups->mu);
      lookups->names[i] = std::move(name);
      ++lookups->answered;
    }).detach();
  }
  absl::MutexLock lock(&lookups->mu);
  if (!lookups->mu.AwaitWithTimeout(
          absl::Condition(lookups.get(), &Lookups::AllAnswered), budget)) {
    return std::vector<std::string>(addresses.size());
  }
  return lookups->names;
}

absl::StatusOr<std::vector<std::string>> ResolveInPodOrder(
    const std::string& host, const std::string& port) {
  absl::StatusOr<std::vector<std::string>> addresses =
      ResolveWithGetaddrinfo(host, port);
  if (!addresses.ok() || addresses->size() < 2) return addresses;
  const std::vector<std::string> names = ReverseNamesWithin(
      *addresses, ReverseResolveWithGetnameinfo, absl::Seconds(2));
  std::vector<std::string> ordered = *addresses;
  return InPodOrdinalOrder(std::move(ordered), [&](const std::string& address) {
    const size_t i = std::find(addresses->begin(), addresses->end(), address) -
                     addresses->begin();
    return i < names.size() ? names[i] : std::string();
  });
}

}  // namespace detlogp::client
