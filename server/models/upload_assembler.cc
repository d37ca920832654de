#include "server/models/upload_assembler.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"

namespace detlogp::server {

namespace {

// Maps [data, data + size) in one call instead of a page fault for every
// 4 KiB the copy touches first (those faults were a quarter of a chain
// replica's CPU). Only whole pages; a kernel without MADV_POPULATE_WRITE
// faults them as before.
void Prefault(char* data, int64_t size) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin =
      (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(size)) &
      ~(page - 1);
  if (end > begin) {
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
  }
}

}  // namespace

UploadAssembler::UploadAssembler(const digests::LmHeadShape& shape,
                                 VersionWriter* writer, int hash_threads)
    : total_bytes_(shape.weight_bytes() + shape.bias_bytes()),
      weights_(std::make_shared<LmHeadWeights>()),
      digest_(shape),
      writer_(writer) {
  weights_->hidden_size = shape.hidden_size;
  weights_->vocab_size = shape.vocab_size;
  weights_->padded_vocab_size = shape.padded_vocab_size;
  weights_->weight.resize(shape.weight_bytes() / 2);
  weights_->bias.resize(shape.bias_bytes() / 4);
  next_block_end_ = digest_.num_blocks() > 0 ? digest_.block(0).size : 0;
  for (int i = 0; i < std::max(1, hash_threads); ++i) {
    threads_.emplace_back([this] { HashLoop(); });
  }
  if (writer_ != nullptr) threads_.emplace_back([this] { WriteLoop(); });
}

UploadAssembler::~UploadAssembler() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

const char* UploadAssembler::BlockData(int64_t index) const {
  const digests::LmHeadDigest::Block& block = digest_.block(index);
  const char* base =
      block.segment == 0
          ? reinterpret_cast<const char*>(weights_->weight.data())
          : reinterpret_cast<const char*>(weights_->bias.data());
  return base + block.offset;
}

absl::Status UploadAssembler::Append(const void* data, size_t size) {
  if (received_ + static_cast<int64_t>(size) > total_bytes_) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "chunk",
                          absl::StrCat("more bytes than the header announced (",
                                       total_bytes_, ")"));
  }
  const char* bytes = static_cast<const char*>(data);
  const int64_t weight_bytes =
      static_cast<int64_t>(weights_->weight.size()) * 2;
  char* weight = reinterpret_cast<char*>(weights_->weight.data());
  char* bias = reinterpret_cast<char*>(weights_->bias.data());
  int64_t left = static_cast<int64_t>(size);
  while (left > 0) {
    // Up to the end of the current digest block, so blocks are published
    // as soon as they are whole.
    const int64_t take = std::min(left, next_block_end_ - received_);
    char* dst = received_ < weight_bytes ? weight + received_
                                         : bias + (received_ - weight_bytes);
    if (received_ < weight_bytes &&
        received_ == next_block_end_ - digest_.block(filling_block_).size) {
      // The first bytes of a weight block: its pages, mapped at once.
      Prefault(dst, digest_.block(filling_block_).size);
    }
    std::memcpy(dst, bytes, take);
    bytes += take;
    left -= take;
    received_ += take;
    if (received_ == next_block_end_) {
      ++filling_block_;
      absl::MutexLock lock(&mu_);
      ++blocks_ready_;
      if (blocks_ready_ < digest_.num_blocks()) {
        next_block_end_ += digest_.block(blocks_ready_).size;
      }
    }
  }
  return absl::OkStatus();
}

bool UploadAssembler::AwaitBlock(int64_t index) {
  struct Wait {
    const UploadAssembler* self;
    int64_t index;
  } wait{this, index};
  mu_.Await(absl::Condition(
      +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return w->self->BlockReadyOrStopping(w->index);
      },
      &wait));
  return blocks_ready_ > index;
}

void UploadAssembler::HashLoop() {
  while (true) {
    int64_t index;
    {
      absl::MutexLock lock(&mu_);
      index = next_to_hash_++;
      if (index >= digest_.num_blocks() || !AwaitBlock(index)) return;
    }
    digest_.HashBlock(index, BlockData(index));
  }
}

void UploadAssembler::WriteLoop() {
  for (int64_t index = 0; index < digest_.num_blocks(); ++index) {
    {
      absl::MutexLock lock(&mu_);
      if (!AwaitBlock(index)) return;  // stopping
    }
    absl::Status status =
        writer_->Append(BlockData(index), digest_.block(index).size);
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      write_status_ = std::move(status);
      return;
    }
  }
}

absl::StatusOr<std::string> UploadAssembler::Finish() {
  if (received_ != total_bytes_) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "chunk",
        absl::StrCat("the upload ended after ", received_, " of the ",
                     total_bytes_, " bytes the header announced"));
  }
  for (std::thread& thread : threads_) thread.join();
  absl::MutexLock lock(&mu_);
  if (!write_status_.ok()) return write_status_;
  weights_->sha256 = digest_.Finish();
  return weights_->sha256;
}

std::shared_ptr<LmHeadWeights> UploadAssembler::TakeWeights() {
  return std::move(weights_);
}

}  // namespace detlogp::server
