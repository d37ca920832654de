// SHA-256 through OpenSSL, as lowercase hex.
#ifndef DETLOGP_DIGESTS_SHA256_H_
#define DETLOGP_DIGESTS_SHA256_H_

#include <cstddef>
#include <memory>
#include <string>

namespace detlogp::digests {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t size);
  void Update(const std::string& text) { Update(text.data(), text.size()); }
  // The 32 raw bytes; either ends the hash.
  std::string Digest();
  std::string HexDigest();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

inline std::string Sha256Hex(const std::string& text) {
  Sha256 hash;
  hash.Update(text);
  return hash.HexDigest();
}

}  // namespace detlogp::digests

#endif  // DETLOGP_DIGESTS_SHA256_H_
