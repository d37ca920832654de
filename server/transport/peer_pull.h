// Pull on start: a replica that starts (or restarts) asks its peers which
// versions they serve and copies the newest before it reports ready, so a
// fleet that gained or lost a replica still serves one version everywhere.
//
// Each peer is asked (ListModels) for its models; the peer whose default
// model has the highest ready version is the source. For each of that
// peer's models whose latest number is above this server's, the version is
// downloaded (DownloadModel), hashed as an upload is, checked against the
// peer's digest and published under the peer's number. Peers that cannot be
// reached are skipped; with none reachable, or none ahead, nothing changes.
//
//   PeerPuller::Options options;
//   options.peers = {"detlogp-0.detlogp:50051", "detlogp-1.detlogp:50051"};
//   auto pulled = PullFromPeers(options, manager, store);
#ifndef DETLOGP_SERVER_TRANSPORT_PEER_PULL_H_
#define DETLOGP_SERVER_TRANSPORT_PEER_PULL_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/models/model_manager.h"
#include "server/models/model_store.h"

namespace detlogp::server {

struct PeerPullOptions {
  // "host:port" of each peer, in order of preference on ties. The list may
  // name this server too (every pod gets the same list): it is never ahead
  // of itself, so nothing is pulled from it.
  std::vector<std::string> peers;
  // Bound on asking one peer, and on the whole download.
  absl::Duration ask_timeout = absl::Seconds(5);
  absl::Duration download_timeout = absl::Minutes(10);
  // How to reach peers; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Sent as "authorization: Bearer <token>" (the peers' admin token);
  // empty: none (peers on loopback).
  std::string admin_token;
  // Bytes as they arrive, for detlogp_model_bytes_received_total{from}.
  std::function<void(absl::string_view from, int64_t bytes)> on_bytes;
};

// What a pull did: "model vN from peer" per version pulled.
struct PullReport {
  std::string source;  // the peer pulled from; empty: none
  std::vector<std::string> pulled;
};

// Errors only for a download that failed or did not check out (this server
// must not report ready then); unreachable peers are not errors.
absl::StatusOr<PullReport> PullFromPeers(const PeerPullOptions& options,
                                         ModelManager* manager,
                                         ModelStore* store);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_TRANSPORT_PEER_PULL_H_
