#include "kernels/top_k_screen_key.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "kernels/split_policy.h"

namespace detlogp::kernels {
namespace {

uint32_t Bits(float z) {
  uint32_t b;
  std::memcpy(&b, &z, sizeof(b));
  return b;
}

// Every float a screen can hold, in ascending order, with the edges.
std::vector<float> AscendingFloats() {
  const float inf = std::numeric_limits<float>::infinity();
  const float denorm = std::numeric_limits<float>::denorm_min();
  std::vector<float> v = {-inf,     -FLT_MAX, -1e30f, -2.0f,   -1.0f,
                          -FLT_MIN, -denorm,  0.0f,   denorm,  FLT_MIN,
                          1.0f,     2.0f,     1e30f,  FLT_MAX, inf};
  std::mt19937 rng(20261201);
  std::uniform_int_distribution<uint32_t> bits;
  while (v.size() < 100000) {
    const uint32_t b = bits(rng);
    float z;
    std::memcpy(&z, &b, sizeof(z));
    if (!std::isnan(z)) v.push_back(z);
  }
  std::sort(v.begin(), v.end());
  return v;
}

TEST(TopKScreenKey, KeysFollowTheFloatOrder) {
  const std::vector<float> v = AscendingFloats();
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i - 1] < v[i]) {
      EXPECT_LT(ScreenKey(v[i - 1]), ScreenKey(v[i]))
          << v[i - 1] << " vs " << v[i];
    } else {  // equal floats: only -0 == +0 may differ, and -0 goes first
      EXPECT_LE(ScreenKey(v[i - 1]), ScreenKey(v[i]));
    }
  }
  EXPECT_LT(ScreenKey(-0.0f), ScreenKey(0.0f));
}

TEST(TopKScreenKey, ValuesComeBackBitForBit) {
  for (float z : AscendingFloats()) {
    EXPECT_EQ(Bits(ScreenValue(ScreenKey(z))), Bits(z)) << z;
  }
  EXPECT_EQ(Bits(ScreenValue(ScreenKey(-0.0f))), Bits(-0.0f));
}

// A cleared screen (key 0) is below every float and reads as -inf; so does
// any key below -inf's (the negative NaN patterns).
TEST(TopKScreenKey, ClearedScreenIsMinusInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ScreenValue(0u), -inf);
  EXPECT_EQ(ScreenValue(1u), -inf);
  EXPECT_EQ(ScreenValue(ScreenKey(-inf) - 1), -inf);
  EXPECT_EQ(ScreenKey(-inf), 0x007fffffu);
  EXPECT_LT(0u, ScreenKey(-inf));
  EXPECT_GT(ScreenValue(ScreenKey(-FLT_MAX)), -inf);
}

// The largest key of a set is the key of its largest float: what an
// atomicMax over keys leaves is the max of the values written.
TEST(TopKScreenKey, MaxOfKeysIsKeyOfMax) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int trial = 0; trial < 1000; ++trial) {
    uint32_t key = 0;  // cleared
    float best = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < 1 + trial % 17; ++i) {
      const float z = normal(rng);
      key = std::max(key, ScreenKey(z));
      best = std::max(best, z);
    }
    EXPECT_EQ(Bits(ScreenValue(key)), Bits(best));
  }
}

// A thread's slot is in range and keeps its place in the quad, so a row's
// four threads never share a slot within a tile.
TEST(TopKScreenSlot, InRangeAndOnePerQuadThread) {
  for (int v0 = 0; v0 < (1 << 22); v0 += 32) {
    for (int quad = 0; quad < 4; ++quad) {
      const int slot = ScreenSlot(v0, quad);
      ASSERT_GE(slot, 0);
      ASSERT_LT(slot, kScreenSlots);
      ASSERT_EQ(slot % 4, quad) << "v0 " << v0;
    }
  }
}

// The first tiles of neighbouring splits fold side by side (16.5 splits of
// a row per wave at N = 1024 on 132 SMs), so they must spread over the 16
// slot groups, or too few slots are set to bound the row's k-th best. The
// old map, (v0 / 32) mod 16, gave 4 groups for every 16 neighbouring
// splits at V = 151936 and 152064.
TEST(TopKScreenSlot, FirstTilesOfNeighbouringSplitsSpreadOverGroups) {
  for (const int64_t vocab : {151936, 152064, 128256, 50257, 32000, 256000}) {
    const int splits = NumVocabSplits(vocab);
    double total = 0.0;
    int windows = 0;
    for (int first = 0; first + 16 <= splits; ++first, ++windows) {
      std::set<int> groups;
      for (int s = first; s < first + 16; ++s) {
        const int start = static_cast<int>(VocabSplitRange(vocab, s).begin);
        groups.insert(ScreenSlot(start, 0) / 4);
      }
      EXPECT_GE(groups.size(), 6u)
          << "V " << vocab << " splits " << first << "..";
      total += groups.size();
    }
    EXPECT_GE(total / windows, 9.5) << "V " << vocab;
  }
}

// The 0-1 principle: a comparator network sorts every input iff it sorts
// every input of zeros and ones, so the 2^16 of those prove the network.
TEST(TopKScreenKey, SortNetworkSortsEveryInputOfZerosAndOnes) {
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    uint32_t keys[16];
    for (int i = 0; i < 16; ++i) keys[i] = (bits >> i) & 1u;
    SortKeysDescending<16>(keys);
    const int ones = __builtin_popcount(bits);
    for (int i = 0; i < 16; ++i) {
      ASSERT_EQ(keys[i], i < ones ? 1u : 0u) << "input " << bits;
    }
  }
}

TEST(TopKScreenKey, SortNetworkSortsKeysOfFloatsLikeTheFloats) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int round = 0; round < 1000; ++round) {
    float z[16];
    uint32_t keys[16];
    for (int i = 0; i < 16; ++i) {
      z[i] =
          round % 7 == 0 && i > 0 && i % 3 == 0 ? z[0] : normal(rng);  // ties
      keys[i] = round % 5 == 0 && i % 4 == 0 ? 0u : ScreenKey(z[i]);
    }
    std::vector<float> want;
    for (int i = 0; i < 16; ++i) want.push_back(ScreenValue(keys[i]));
    std::sort(want.begin(), want.end(), std::greater<float>());
    SortKeysDescending<16>(keys);
    for (int i = 0; i < 16; ++i) {
      EXPECT_EQ(Bits(ScreenValue(keys[i])), Bits(want[i])) << round << " " << i;
    }
  }
}

}  // namespace
}  // namespace detlogp::kernels
