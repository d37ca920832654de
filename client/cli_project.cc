#include "client/cli_project.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/heap_retention.h"
#include "client/process_usage.h"
#include "digests/sha256.h"
#include "kernels/random_normal.h"

namespace detlogp::client {
namespace {

// Y is [rows, 5376] float32.
constexpr double kOutputBytesPerRow = 5376.0 * 4;
constexpr int64_t kInputColumns = 96;

// SHA-256 of Y's chunks, in arrival order, on a thread of its own: one core
// hashes at 1.5-2 GB/s (OpenSSL), slower than the stream it would otherwise
// hold up. The receiving thread hands each chunk over as it came from gRPC
// (moved: the hasher holds references to gRPC's receive slices and hashes
// y.data straight from them, no copy). At most max_backlog_bytes wait to be
// hashed (one chunk at least); past that the receiver waits, and the time it
// waited is reported.
class ChunkHasher {
 public:
  explicit ChunkHasher(size_t max_backlog_bytes)
      : max_backlog_bytes_(max_backlog_bytes), thread_([this] { Run(); }) {}
  ~ChunkHasher() { Finish(); }

  // Takes the chunk (its slices; y.data is never copied).
  void Add(ProjectChunk chunk) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto room = [&] {
      return backlog_bytes_ == 0 || backlog_bytes_ < max_backlog_bytes_;
    };
    if (!room()) {
      const absl::Time wait_start = absl::Now();
      room_.wait(lock, room);
      waited_ += absl::Now() - wait_start;
    }
    backlog_bytes_ += static_cast<size_t>(chunk.y_data_bytes);
    queue_.push_back(std::move(chunk));
    work_.notify_one();
  }

  // Hashes what is queued, stops the thread; the digest as lowercase hex.
  std::string Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      work_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
    if (hex_.empty()) hex_ = digest_.HexDigest();
    return hex_;
  }

  // Valid after Finish: time spent in SHA-256, bytes hashed, and the time
  // the receiving thread waited for room in the backlog.
  absl::Duration hashing() const { return hashing_; }
  int64_t bytes() const { return bytes_; }
  absl::Duration waited() const { return waited_; }

 private:
  void Run() {
    for (;;) {
      ProjectChunk chunk;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [&] { return done_ || !queue_.empty(); });
        if (queue_.empty()) return;
        chunk = std::move(queue_.front());
        queue_.pop_front();
      }
      const absl::Time start = absl::Now();
      for (absl::string_view piece : chunk.y_data) {
        digest_.Update(piece.data(), piece.size());
      }
      hashing_ += absl::Now() - start;
      bytes_ += chunk.y_data_bytes;
      const size_t hashed = static_cast<size_t>(chunk.y_data_bytes);
      chunk = ProjectChunk();  // gRPC's slices go back first
      std::lock_guard<std::mutex> lock(mu_);
      backlog_bytes_ -= hashed;
      room_.notify_one();
    }
  }

  const size_t max_backlog_bytes_;
  std::mutex mu_;
  std::condition_variable work_;  // a chunk queued, or done_
  std::condition_variable room_;  // backlog_bytes_ went down
  std::deque<ProjectChunk> queue_;
  size_t backlog_bytes_ = 0;
  bool done_ = false;
  absl::Duration waited_;  // written by the receiving thread only
  // Written by the hashing thread only; read after the join.
  digests::Sha256 digest_;
  absl::Duration hashing_;
  int64_t bytes_ = 0;
  std::string hex_;
  std::thread thread_;  // last: starts once the members above exist
};

absl::Status ProjectOnce(LogpClient& client, const std::vector<float>& x,
                         const ProjectCommandOptions& options) {
  const int64_t rows = options.rows;
  ChunkHasher hasher(
      static_cast<size_t>(std::max<int64_t>(0, options.hash_backlog_bytes)));
  absl::Duration first_chunk = absl::InfiniteDuration();
  const ProcessUsage usage_before = ProcessUsage::Now();
  const absl::Time start = absl::Now();
  LogpClient::ProjectOptions project_options;
  project_options.rows_per_chunk = options.rows_per_chunk;
  project_options.streams = options.streams;
  // Read raw: only each chunk's header is parsed; y.data stays in gRPC's
  // receive slices and is hashed from there.
  auto result =
      client.ProjectChunks(x, rows, project_options, [&](ProjectChunk& chunk) {
        if (first_chunk == absl::InfiniteDuration())
          first_chunk = absl::Now() - start;
        if (options.hash_y) hasher.Add(std::move(chunk));
      });
  const double transfer = absl::ToDoubleSeconds(absl::Now() - start);
  const std::string y_sha256 = options.hash_y ? hasher.Finish() : "-";
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const ProcessUsage usage = ProcessUsage::Now() - usage_before;
  if (!result.ok()) return result.status();
  const double output_bytes = rows * kOutputBytesPerRow;
  const double hashing = absl::ToDoubleSeconds(hasher.hashing());
  std::printf(
      "determinism_key %s\ny_sha256 %s\nrows %lld chunks %lld "
      "seconds %.3f output_GB/s %.2f\n",
      result->determinism_key.c_str(), y_sha256.c_str(),
      static_cast<long long>(rows), static_cast<long long>(result->chunks),
      seconds, output_bytes / seconds / 1e9);
  std::printf(
      "transfer seconds %.3f output_GB/s %.2f first_chunk_seconds %.3f "
      "waited_for_hashing_seconds %.3f streams %d\n",
      transfer, output_bytes / transfer / 1e9,
      result->chunks > 0 ? absl::ToDoubleSeconds(first_chunk) : 0.0,
      absl::ToDoubleSeconds(hasher.waited()), result->streams);
  std::printf("sha256 seconds %.3f GB/s %.2f after_transfer_seconds %.3f\n",
              hashing, hashing > 0 ? hasher.bytes() / hashing / 1e9 : 0.0,
              seconds - transfer);
  const std::optional<std::string> hugetlb =
      MallocHugePagesTunable(std::getenv("GLIBC_TUNABLES"));
  std::printf(
      "client cpu_seconds %.3f minor_page_faults %lld per_GB %.0f "
      "malloc_hugetlb %s\n",
      usage.cpu_seconds, static_cast<long long>(usage.minor_page_faults),
      output_bytes > 0 ? usage.minor_page_faults / (output_bytes / 1e9) : 0.0,
      hugetlb.value_or("-").c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

// Runs after the first see what a long-lived client sees: the first also
// pays for the process's heap growing to a stream's working set (page
// faults that grow with rows_per_chunk).
absl::Status RunProject(LogpClient& client,
                        const ProjectCommandOptions& options) {
  if (options.repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--project_repeats=", options.repeats, ", expected 1 or more"));
  }
  if (options.rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--project_rows=", options.rows, " is negative"));
  }
  kernels::RandomNormal random(options.seed);
  std::vector<float> x(options.rows * kInputColumns);
  for (float& v : x) v = random.Next(1.0f);
  for (int run = 0; run < options.repeats; ++run) {
    if (absl::Status s = ProjectOnce(client, x, options); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace detlogp::client
