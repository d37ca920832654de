#include "server/shared_memory/mapped_reads.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "tests/truncatable_shm.h"

namespace detlogp::server {
namespace {

using detlogp::testing::TruncatableShm;

// Four pages of a recognisable pattern; pages 1-3 vanish once truncated.
std::unique_ptr<TruncatableShm> PatternedShm() {
  auto shm = TruncatableShm::Create(4);
  if (shm == nullptr) return nullptr;
  for (size_t i = 0; i < shm->bytes(); ++i) {
    shm->data()[i] = static_cast<char>(i * 7 + 3);
  }
  return shm;
}

TEST(MappedReadsTest, CopiesAnIntactMappingByteForByte) {
  auto shm = PatternedShm();
  ASSERT_NE(shm, nullptr);
  std::vector<char> copy(shm->bytes() - 5);
  ASSERT_TRUE(CopyFromMapping(copy.data(), shm->data() + 5, copy.size()).ok());
  EXPECT_EQ(std::memcmp(copy.data(), shm->data() + 5, copy.size()), 0);
  // Ordinary memory works the same; nothing to read is nothing to fault.
  const std::string heap = "ordinary bytes";
  std::string out(heap.size(), '\0');
  ASSERT_TRUE(CopyFromMapping(out.data(), heap.data(), heap.size()).ok());
  EXPECT_EQ(out, heap);
  EXPECT_TRUE(CopyFromMapping(out.data(), nullptr, 0).ok());
}

TEST(MappedReadsTest, ATruncatedMappingIsAStatusNotACrash) {
  auto shm = PatternedShm();
  ASSERT_NE(shm, nullptr);
  std::vector<char> expected(shm->data(), shm->data() + shm->bytes());
  ASSERT_TRUE(shm->TruncateToPages(1));
  std::vector<char> copy(shm->bytes());
  const absl::Status lost =
      CopyFromMapping(copy.data(), shm->data(), copy.size());
  EXPECT_EQ(lost.code(), absl::StatusCode::kFailedPrecondition) << lost;
  EXPECT_TRUE(absl::StrContains(lost.message(), "truncated")) << lost;
  // Again, and from the middle of a vanished page: each fault is caught
  // (the jump out of the handler unblocked SIGBUS).
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(CopyFromMapping(copy.data(), shm->page(2) + 100, 10).ok());
  }
  // The page still in the object reads as before.
  const size_t page = TruncatableShm::PageBytes();
  ASSERT_TRUE(CopyFromMapping(copy.data(), shm->data(), page).ok());
  EXPECT_EQ(std::memcmp(copy.data(), expected.data(), page), 0);
}

TEST(MappedReadsTest, ReadFromMappingGuardsTheCallersOwnRead) {
  auto shm = PatternedShm();
  ASSERT_NE(shm, nullptr);
  const char* rows = shm->page(1);
  const size_t bytes = 2 * TruncatableShm::PageBytes();
  std::vector<int> sums(1, 0);
  const auto sum = [&] {
    int total = 0;
    for (size_t i = 0; i < bytes; ++i) total += rows[i];
    sums[0] = total;
  };
  ASSERT_TRUE(ReadFromMapping(rows, bytes, sum).ok());
  int expected = 0;
  for (size_t i = 0; i < bytes; ++i) expected += rows[i];
  EXPECT_EQ(sums[0], expected);
  ASSERT_TRUE(shm->TruncateToPages(2));  // page 2 vanishes mid-read
  EXPECT_EQ(ReadFromMapping(rows, bytes, sum).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(MappedReadsTest, ThreadsFaultingAtOnceEachGetTheirOwnAnswer) {
  auto intact = PatternedShm();
  auto truncated = PatternedShm();
  ASSERT_NE(intact, nullptr);
  ASSERT_NE(truncated, nullptr);
  ASSERT_TRUE(truncated->TruncateToPages(0));
  std::vector<std::thread> threads;
  std::vector<int> wrong(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::vector<char> copy(intact->bytes());
      for (int i = 0; i < 200; ++i) {
        const bool faulting = (t + i) % 2 == 0;
        const TruncatableShm& shm = faulting ? *truncated : *intact;
        const absl::Status read =
            CopyFromMapping(copy.data(), shm.data(), copy.size());
        const bool right =
            faulting ? read.code() == absl::StatusCode::kFailedPrecondition
                     : read.ok() && std::memcmp(copy.data(), intact->data(),
                                                copy.size()) == 0;
        if (!right) ++wrong[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(wrong[t], 0) << "thread " << t;
}

TEST(MappedReadsTest, RegionShrankErrorNamesTheFieldAndTheRegion) {
  const absl::Status status = RegionShrankError("hidden.shared_memory", "rows");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(status.message(),
                               "hidden.shared_memory: region \"rows\" shrank"))
      << status;
}

// A SIGBUS no guarded read takes keeps its usual effect: the process dies.
TEST(MappedReadsDeathTest, AFaultOutsideAGuardedReadStillKills) {
  auto shm = PatternedShm();
  ASSERT_NE(shm, nullptr);
  char byte = 0;
  ASSERT_TRUE(CopyFromMapping(&byte, shm->data(), 1).ok());  // installed
  ASSERT_TRUE(shm->TruncateToPages(1));
  EXPECT_EXIT(
      {
        const volatile char* vanished = shm->page(2);
        byte = *vanished;
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

TEST(MappedReadsDeathTest, AFaultOutsideTheGuardedBytesStillKills) {
  auto guarded = PatternedShm();
  auto other = PatternedShm();
  ASSERT_NE(guarded, nullptr);
  ASSERT_NE(other, nullptr);
  ASSERT_TRUE(other->TruncateToPages(0));
  EXPECT_EXIT(
      {
        char byte = 0;
        const absl::Status status =
            ReadFromMapping(guarded->data(), guarded->bytes(), [&] {
              const volatile char* vanished = other->data();
              byte = *vanished;
            });
        std::fprintf(stderr, "survived: %s %d\n", status.ToString().c_str(),
                     byte);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

TEST(MappedReadsDeathTest, ASigbusSentByAProcessStillKills) {
  char byte = 0;
  const char source = 1;
  ASSERT_TRUE(CopyFromMapping(&byte, &source, 1).ok());  // installed
  EXPECT_EXIT(kill(getpid(), SIGBUS), ::testing::KilledBySignal(SIGBUS), "");
}

}  // namespace
}  // namespace detlogp::server
