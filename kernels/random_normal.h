// A portable, seeded normal generator for synthetic weights and test data: the
// same seed gives the same floats on every platform and standard library
// (std::normal_distribution does not).
#ifndef DETLOGP_KERNELS_RANDOM_NORMAL_H_
#define DETLOGP_KERNELS_RANDOM_NORMAL_H_

#include <cmath>
#include <cstdint>

namespace detlogp::kernels {

class RandomNormal {
 public:
  explicit RandomNormal(uint64_t seed) : state_(seed) {}

  // splitmix64 then Box-Muller; doubles keep the result libm-stable enough
  // for synthetic weights (only their digest matters for the contract).
  float Next(float stddev) {
    const double u1 = (static_cast<double>(NextBits() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(NextBits() >> 11) * 0x1.0p-53;
    return static_cast<float>(stddev * std::sqrt(-2.0 * std::log(u1)) *
                              std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t NextBits() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  uint64_t state_;
};

}  // namespace detlogp::kernels

#endif  // DETLOGP_KERNELS_RANDOM_NORMAL_H_
