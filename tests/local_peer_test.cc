// Which callers count as "on this host" for shared memory.
#include "server/transport/local_peer.h"

#include <gtest/gtest.h>

namespace detlogp::server {
namespace {

TEST(LocalPeerTest, UnixSocketsAndLoopbackAreLocal) {
  for (const char* peer :
       {"unix:/tmp/detlogp.sock", "unix:", "unix-abstract:detlogp",
        "ipv4:127.0.0.1:50051", "ipv4:127.1.2.3:1", "ipv6:[::1]:50051",
        "ipv6:%5B::1%5D:50051", "ipv6:[::ffff:127.0.0.1]:7"}) {
    EXPECT_TRUE(IsSameHostPeer(peer)) << peer;
  }
}

TEST(LocalPeerTest, EveryOtherAddressIsNot) {
  for (const char* peer :
       {"ipv4:10.0.0.7:50051", "ipv4:128.0.0.1:1", "ipv4:0.0.0.0:1",
        "ipv6:[::2]:50051", "ipv6:[fe80::1%25eth0]:1",
        "ipv6:[::ffff:10.0.0.1]:7", "ipv6:[2001:db8::1]:443",
        "ipv4:", "ipv6:", "ipv6:[::1", "ipv4:127.0.0.1", "", "vsock:3:5000",
        "ipv4:localhost:1"}) {
    EXPECT_FALSE(IsSameHostPeer(peer)) << peer;
  }
}

TEST(LocalPeerTest, LoopbackListenAddresses) {
  for (const char* host : {"127.0.0.1", "::1", "localhost", "127.0.0.2"}) {
    EXPECT_TRUE(IsLoopbackListenAddress(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "::", "10.1.2.3", "example.com", ""}) {
    EXPECT_FALSE(IsLoopbackListenAddress(host)) << host;
  }
}

}  // namespace
}  // namespace detlogp::server
