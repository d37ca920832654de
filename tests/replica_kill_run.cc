#include "tests/replica_kill_run.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <iostream>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tests/score_result_bits.h"

namespace detlogp::testing {

KillRunCounts ScoreWhileKilling(client::LogpClient& client,
                                const std::vector<v1::LogProbRequest>& requests,
                                const std::vector<client::ScoreResult>& wanted,
                                ServerProcess& victim, const KillRun& run) {
  std::atomic<int> calls{0}, calls_after_kill{0}, failed{0}, wrong_bits{0},
      other_path{0};
  std::atomic<int64_t> replica_retries{0};
  std::atomic<bool> killed{false};
  absl::Notification kill_now;
  std::vector<std::thread> threads;
  for (size_t t = 0; t < requests.size(); ++t) {
    threads.emplace_back([&, t] {
      while (calls_after_kill.load() < run.calls_after_kill) {
        const bool after = killed.load();
        auto answer = client.Score(requests[t]);
        if (!answer.ok()) {
          ADD_FAILURE() << answer.status();
          ++failed;
          return;
        }
        if (!SameBits(*answer, wanted[t])) ++wrong_bits;
        if (!run.path.empty() && answer->path != run.path) ++other_path;
        replica_retries += answer->replica_retries;
        if (++calls == run.calls_before_kill) kill_now.Notify();
        if (after) ++calls_after_kill;
      }
    });
  }
  // The threads score without pause: requests are in flight at the kill.
  const absl::Time start = absl::Now();
  kill_now.WaitForNotification();
  EXPECT_EQ(victim.Stop(SIGKILL), 128 + SIGKILL);
  killed = true;
  for (std::thread& thread : threads) thread.join();
  KillRunCounts counts;
  counts.calls = calls.load();
  counts.calls_after_kill = calls_after_kill.load();
  counts.failed = failed.load();
  counts.wrong_bits = wrong_bits.load();
  counts.other_path = other_path.load();
  counts.replica_retries = replica_retries.load();
  std::cout << counts.calls << " calls of " << requests.size() << " threads in "
            << absl::FormatDuration(absl::Now() - start) << ", "
            << counts.calls_after_kill << " begun after the kill, "
            << counts.failed << " failed, " << counts.wrong_bits
            << " with other bits, " << counts.replica_retries
            << " requests sent again to another replica\n";
  return counts;
}

}  // namespace detlogp::testing
