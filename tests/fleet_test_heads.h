// The small "policy" lm_heads the fleet tests push between replicas, and
// what they read back from a replica.
#ifndef DETLOGP_TESTS_FLEET_TEST_HEADS_H_
#define DETLOGP_TESTS_FLEET_TEST_HEADS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "client/model_repository_client.h"
#include "tests/server_process.h"

namespace detlogp::testing {

// [kFleetVocab, kFleetHidden] bf16 weight + fp32 bias: 520,000 bytes of
// one version on the CPU backend.
inline constexpr int64_t kFleetHidden = 128;
inline constexpr int64_t kFleetVocab = 2000;

// Weights ~ N(0, 0.02^2) and bias ~ N(0, 0.1^2) of model "policy", fixed by
// `seed`; version 0 (the server numbers it).
client::LmHeadUpload RandomLmHead(uint64_t seed);
// One training step's worth of change: ~4% of the weights move by one bf16
// step and a few bias values move; version 0.
client::LmHeadUpload Step(const client::LmHeadUpload& base, uint64_t seed);

std::unique_ptr<client::ModelRepositoryClient> Repo(
    const ServerProcess& server);
// The latest version of "policy" on `server` (0: none).
int64_t Latest(const ServerProcess& server);
// The value of detlogp_model_bytes_received_total{from="<from>"} (-1, and
// a test failure, when it is missing).
double BytesReceived(const ServerProcess& server, const std::string& from);

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_FLEET_TEST_HEADS_H_
