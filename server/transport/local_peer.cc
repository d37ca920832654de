#include "server/transport/local_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_replace.h"

namespace detlogp::server {
namespace {

bool IsLoopbackV4(const in_addr& address) {
  return (ntohl(address.s_addr) >> 24) == 127;
}

bool IsLoopbackAddress(const std::string& address) {
  in_addr v4;
  if (inet_pton(AF_INET, address.c_str(), &v4) == 1) return IsLoopbackV4(v4);
  in6_addr v6;
  if (inet_pton(AF_INET6, address.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  if (IN6_IS_ADDR_V4MAPPED(&v6)) {
    in_addr mapped;
    std::memcpy(&mapped, &v6.s6_addr[12], 4);
    return IsLoopbackV4(mapped);
  }
  return false;
}

}  // namespace

bool IsSameHostPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") ||
      absl::StartsWith(peer, "unix-abstract:")) {
    return true;
  }
  if (absl::ConsumePrefix(&peer, "ipv4:")) {
    const size_t colon = peer.rfind(':');
    if (colon == absl::string_view::npos) return false;
    return IsLoopbackAddress(std::string(peer.substr(0, colon)));
  }
  if (absl::ConsumePrefix(&peer, "ipv6:")) {
    const std::string decoded = absl::StrReplaceAll(
        peer, {{"%5B", "["}, {"%5b", "["}, {"%5D", "]"}, {"%5d", "]"}});
    if (decoded.empty() || decoded[0] != '[') return false;
    const size_t close = decoded.find(']');
    if (close == std::string::npos) return false;
    std::string address = decoded.substr(1, close - 1);
    // A zone ("fe80::1%eth0", "%25" encoded) is never loopback.
    if (address.find('%') != std::string::npos) return false;
    return IsLoopbackAddress(address);
  }
  return false;
}

bool IsLoopbackListenAddress(const std::string& host) {
  return host == "localhost" || IsLoopbackAddress(host);
}

}  // namespace detlogp::server
