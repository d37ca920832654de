#include "tests/fleet_test_heads.h"

#include <gtest/gtest.h>

#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/bfloat16.h"
#include "kernels/random_normal.h"

namespace detlogp::testing {

client::LmHeadUpload RandomLmHead(uint64_t seed) {
  client::LmHeadUpload upload;
  upload.model = "policy";
  upload.hidden_size = kFleetHidden;
  upload.padded_vocab_size = kFleetVocab;
  kernels::RandomNormal random(seed * 7919 + 11);
  upload.weight.resize(kFleetVocab * kFleetHidden);
  for (uint16_t& w : upload.weight) {
    w = kernels::FloatToBf16(random.Next(0.02f));
  }
  upload.bias.resize(kFleetVocab);
  for (float& b : upload.bias) b = random.Next(0.1f);
  return upload;
}

client::LmHeadUpload Step(const client::LmHeadUpload& base, uint64_t seed) {
  client::LmHeadUpload next = base;
  std::mt19937_64 random(seed);
  std::bernoulli_distribution changes(0.04);
  for (uint16_t& w : next.weight) {
    if (changes(random)) w = static_cast<uint16_t>(w ^ 1);
  }
  for (size_t i = 0; i < next.bias.size(); i += 97) next.bias[i] += 1e-3f;
  next.version = 0;
  return next;
}

std::unique_ptr<client::ModelRepositoryClient> Repo(
    const ServerProcess& server) {
  client::LogpClient::Options connection;
  connection.target = server.target();
  return *client::ModelRepositoryClient::Create(connection, {});
}

int64_t Latest(const ServerProcess& server) {
  auto models = Repo(server)->ListModels();
  EXPECT_TRUE(models.ok()) << models.status();
  if (!models.ok()) return 0;
  for (const auto& info : models->models()) {
    if (info.model() == "policy") return info.model_version();
  }
  return 0;
}

double BytesReceived(const ServerProcess& server, const std::string& from) {
  auto text = server.HttpGet("/metrics");
  EXPECT_TRUE(text.ok()) << text.status();
  const std::string key =
      absl::StrCat("detlogp_model_bytes_received_total{from=\"", from, "\"} ");
  const size_t at = text.ok() ? text->find(key) : std::string::npos;
  EXPECT_NE(at, std::string::npos) << (text.ok() ? *text : "");
  if (at == std::string::npos) return -1;
  const size_t begin = at + key.size();
  double value = -1;
  EXPECT_TRUE(absl::SimpleAtod(
      text->substr(begin, text->find('\n', begin) - begin), &value));
  return value;
}

}  // namespace detlogp::testing
