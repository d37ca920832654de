// The bytes a server sends a peer pulling a version (DownloadModel): read
// from the host copy, else from the placed model (here the CPU backend's,
// read back as a GPU's would be), else from the version's files; every
// range, across the weight and the bias, is the upload's bytes.
#include "server/models/version_bytes.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "proto/status_details.h"
#include "server/backends/cpu_backend.h"

namespace detlogp::server {
namespace {

std::shared_ptr<const LmHeadWeights> RandomWeights(bool bias) {
  auto weights = std::make_shared<LmHeadWeights>();
  weights->hidden_size = 48;
  weights->vocab_size = 250;
  weights->padded_vocab_size = 256;
  std::mt19937 random(7);
  weights->weight.resize(256 * 48);
  for (uint16_t& value : weights->weight) value = random() & 0xffff;
  if (bias) {
    for (int i = 0; i < 256; ++i) weights->bias.push_back(random() * 1e-9f);
  }
  return weights;
}

// The upload's payload: weight bytes, then bias bytes.
std::string Payload(const LmHeadWeights& weights) {
  std::string bytes(reinterpret_cast<const char*>(weights.weight.data()),
                    weights.weight.size() * 2);
  bytes.append(reinterpret_cast<const char*>(weights.bias.data()),
               weights.bias.size() * 4);
  return bytes;
}

ServedVersion Served(const LmHeadWeights& weights) {
  ServedVersion version;
  version.model = "policy";
  version.version = 3;
  version.hidden_size = weights.hidden_size;
  version.vocab_size = weights.vocab_size;
  version.padded_vocab_size = weights.padded_vocab_size;
  version.has_bias = !weights.bias.empty();
  return version;
}

// Reads everything in chunks of `chunk` bytes.
std::string ReadAll(const VersionBytes& bytes, int64_t chunk) {
  std::string out(bytes.total_bytes(), '\0');
  for (int64_t offset = 0; offset < bytes.total_bytes(); offset += chunk) {
    const int64_t size = std::min(chunk, bytes.total_bytes() - offset);
    EXPECT_TRUE(bytes.Read(offset, size, out.data() + offset).ok());
  }
  return out;
}

// A model whose backend does not read weights back.
class OpaqueModel final : public LogpModel {
 public:
  OpaqueModel() : LogpModel(48, 250) {}
};

VersionBytes::FileLoader NoFiles() {
  return []() -> absl::StatusOr<std::shared_ptr<const LmHeadWeights>> {
    return absl::NotFoundError("no files of it");
  };
}

TEST(VersionBytesTest, PlacedModelIsReadBackWhenNoHostCopyIsKept) {
  for (bool bias : {true, false}) {
    auto weights = RandomWeights(bias);
    auto backend = CreateCpuBackend(BackendOptions{});
    ASSERT_TRUE(backend.ok()) << backend.status();
    auto placed = (*backend)->Load(weights);
    ASSERT_TRUE(placed.ok()) << placed.status();
    ServedVersion version = Served(*weights);
    version.placed = *placed;  // host_weights left empty, as on a GPU
    auto bytes = VersionBytes::Open(version, NoFiles());
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ((*bytes)->source(), "device");
    EXPECT_EQ((*bytes)->total_bytes(), 256 * 48 * 2 + (bias ? 256 * 4 : 0));
    // Chunks that straddle rows and the weight/bias boundary.
    for (int64_t chunk : {1000, 4096, 1 << 20}) {
      EXPECT_EQ(ReadAll(**bytes, chunk), Payload(*weights)) << chunk;
    }
    std::string one(8, '\0');
    EXPECT_EQ((*bytes)->Read((*bytes)->total_bytes() - 4, 8, one.data()).code(),
              absl::StatusCode::kOutOfRange);
    // The whole head, as a delta upload's base is rebuilt from.
    auto whole = (*bytes)->Weights(version);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_NE(whole->get(), weights.get());
    EXPECT_EQ(Payload(**whole), Payload(*weights));
    EXPECT_EQ((*whole)->padded_vocab_size, weights->padded_vocab_size);
    EXPECT_EQ((*whole)->hidden_size, weights->hidden_size);
  }
}

TEST(VersionBytesTest, HostCopyComesFirstAndFilesLast) {
  auto weights = RandomWeights(true);
  ServedVersion version = Served(*weights);
  version.host_weights = weights;
  version.placed = std::make_shared<OpaqueModel>();
  auto bytes = VersionBytes::Open(version, NoFiles());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ((*bytes)->source(), "host copy");
  EXPECT_EQ(ReadAll(**bytes, 777), Payload(*weights));
  auto whole = (*bytes)->Weights(version);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->get(), weights.get());  // the copy itself, no read

  ServedVersion file_backed = Served(*weights);
  file_backed.placed = std::make_shared<OpaqueModel>();
  bytes = VersionBytes::Open(
      file_backed,
      [&]() -> absl::StatusOr<std::shared_ptr<const LmHeadWeights>> {
        return weights;
      });
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ((*bytes)->source(), "files");
  EXPECT_EQ(ReadAll(**bytes, 4096), Payload(*weights));
}

TEST(VersionBytesTest, NothingToReadIsFailedPreconditionNamingTheVersion) {
  auto weights = RandomWeights(false);
  ServedVersion version = Served(*weights);
  version.placed = std::make_shared<OpaqueModel>();
  auto bytes = VersionBytes::Open(version, NoFiles());
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kFailedPrecondition);
  const v1::ErrorDetails details = v1::DetailsOf(bytes.status());
  EXPECT_EQ(details.reason, v1::kReasonVersionUnavailable);
  ASSERT_FALSE(details.fields.empty());
  EXPECT_EQ(details.fields.front(), "model_version");
}

}  // namespace
}  // namespace detlogp::server
