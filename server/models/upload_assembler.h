// Builds an lm_head from bytes arriving in order (an UploadModel stream):
// copies them into the weight and bias, and, as each 16 MiB digest block
// completes, hashes it on one of several threads and writes it to the
// version's file on another, so hashing and writing keep pace with the
// network instead of following it. Each weight block's pages are mapped in
// one call just before its first bytes are copied (no fault per 4 KiB).
//
//   UploadAssembler assembler(shape, writer);   // writer may be null
//   assembler.Append(chunk.data(), chunk.size());  // in stream order
//   ...
//   auto digest = assembler.Finish();   // all bytes, hashed and written
//   std::shared_ptr<LmHeadWeights> weights = assembler.TakeWeights();
#ifndef DETLOGP_SERVER_MODELS_UPLOAD_ASSEMBLER_H_
#define DETLOGP_SERVER_MODELS_UPLOAD_ASSEMBLER_H_

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "digests/lm_head_digest.h"
#include "server/models/lm_head_weights.h"
#include "server/models/model_store.h"

namespace detlogp::server {

class UploadAssembler {
 public:
  // `writer` (may be null) receives the stream's bytes in order.
  UploadAssembler(const digests::LmHeadShape& shape, VersionWriter* writer,
                  int hash_threads = 8);
  // Stops and joins the threads (an unfinished upload is dropped).
  ~UploadAssembler();
  UploadAssembler(const UploadAssembler&) = delete;
  UploadAssembler& operator=(const UploadAssembler&) = delete;

  int64_t total_bytes() const { return total_bytes_; }
  int64_t received_bytes() const { return received_; }

  // The next bytes of the stream; INVALID_ARGUMENT beyond total_bytes().
  absl::Status Append(const void* data, size_t size);
  // Once every byte arrived: waits for the hashing and writing, returns the
  // digest (or the writer's error).
  absl::StatusOr<std::string> Finish();
  // The assembled weights (after Finish), digest filled in.
  std::shared_ptr<LmHeadWeights> TakeWeights();

 private:
  // Waits until block `index` is whole; false when stopping first.
  bool AwaitBlock(int64_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HashLoop();
  void WriteLoop();
  const char* BlockData(int64_t index) const;
  bool BlockReadyOrStopping(int64_t index) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || blocks_ready_ > index;
  }

  const int64_t total_bytes_;
  std::shared_ptr<LmHeadWeights> weights_;
  digests::LmHeadDigest digest_;
  VersionWriter* const writer_;
  int64_t received_ = 0;        // worker thread only
  int64_t next_block_end_ = 0;  // stream offset where the next block ends
  int64_t filling_block_ = 0;   // worker thread only: the block it copies to

  absl::Mutex mu_;
  int64_t blocks_ready_ ABSL_GUARDED_BY(mu_) = 0;  // copied in full
  int64_t next_to_hash_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status write_status_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_MODELS_UPLOAD_ASSEMBLER_H_
