#include "server/backends/caching_host_buffer_pool.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>
#include <vector>

namespace detlogp::server {

absl::StatusOr<std::shared_ptr<CachingHostBufferPool>>
CachingHostBufferPool::Create(const Options& options) {
  if (options.max_cached_bytes < 0) {
    return absl::InvalidArgumentError(
        "max_cached_bytes: must be >= 0 (0 caches nothing)");
  }
  if (options.block_bytes < 1) {
    return absl::InvalidArgumentError("block_bytes: must be >= 1");
  }
  if (!options.allocate) return absl::InvalidArgumentError("allocate: not set");
  if (!options.free) return absl::InvalidArgumentError("free: not set");
  return std::shared_ptr<CachingHostBufferPool>(
      new CachingHostBufferPool(options));
}

CachingHostBufferPool::~CachingHostBufferPool() {
  absl::MutexLock lock(&mu_);
  for (const Block& block : blocks_) options_.free(block.base);
}

size_t CachingHostBufferPool::Rounded(size_t bytes) {
  return (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment *
         kAlignment;
}

HostBuffer CachingHostBufferPool::Acquire(size_t bytes) {
  const size_t need = Rounded(bytes);
  {
    absl::MutexLock lock(&mu_);
    auto fit = idle_by_size_.lower_bound(IdleRange{need, 0, nullptr, 0});
    if (fit != idle_by_size_.end()) {
      Block* block = fit->block;
      const size_t offset = fit->offset;
      const size_t length = fit->length;
      RemoveIdleLocked(block, block->idle.find(offset));
      if (length > need) AddIdleLocked(block, offset + need, length - need);
      ++stats_.reused;
      return Lend(block, offset, bytes);
    }
  }
  // A new block, pinned outside the lock.
  const size_t block_bytes =
      std::max(need, Rounded(static_cast<size_t>(std::min(
                         options_.block_bytes, options_.max_cached_bytes))));
  char* base = static_cast<char*>(options_.allocate(block_bytes));
  if (base == nullptr) {
    {
      absl::MutexLock lock(&mu_);
      ++stats_.heap_fallbacks;
    }
    if (!warned_.exchange(true)) {
      spdlog::warn(
          "cannot allocate {} bytes of {} memory; chunk buffers that "
          "cannot be had fall back to the heap (slower copies)",
          block_bytes, options_.memory_name);
    }
    return HeapHostBuffer(bytes);  // outside the lock: tens of MB
  }
  absl::MutexLock lock(&mu_);
  Block& block = blocks_.emplace_back();
  block.base = base;
  block.bytes = block_bytes;
  held_bytes_ += static_cast<int64_t>(block_bytes);
  if (block_bytes > need) AddIdleLocked(&block, need, block_bytes - need);
  ++stats_.allocated;
  return Lend(&block, 0, bytes);
}

HostBuffer CachingHostBufferPool::Lend(Block* block, size_t offset,
                                       size_t bytes) {
  // The block outlives the buffer: a block is freed only with nothing in use.
  return HostBuffer(
      block->base + offset, bytes,
      [pool = shared_from_this(), block](char* data, size_t size) {
        pool->Release(block, data, size);
      });
}

void CachingHostBufferPool::Release(Block* block, char* data, size_t bytes) {
  std::vector<char*> evicted;
  {
    absl::MutexLock lock(&mu_);
    size_t offset = static_cast<size_t>(data - block->base);
    size_t length = Rounded(bytes);
    auto next = block->idle.lower_bound(offset);
    if (next != block->idle.end() && next->first == offset + length) {
      length += next->second;
      RemoveIdleLocked(block, next);
      next = block->idle.lower_bound(offset);
    }
    if (next != block->idle.begin()) {
      auto previous = std::prev(next);
      if (previous->first + previous->second == offset) {
        offset = previous->first;
        length += previous->second;
        RemoveIdleLocked(block, previous);
      }
    }
    AddIdleLocked(block, offset, length);
    block->last_release = ++releases_;
    while (stats_.cached_bytes > options_.max_cached_bytes) {
      auto idle_longest = blocks_.end();
      for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
        const bool unused =
            it->idle.size() == 1 && it->idle.begin()->second == it->bytes;
        if (unused && (idle_longest == blocks_.end() ||
                       it->last_release < idle_longest->last_release)) {
          idle_longest = it;
        }
      }
      if (idle_longest == blocks_.end()) break;  // the rest is in blocks in use
      RemoveIdleLocked(&*idle_longest, idle_longest->idle.begin());
      held_bytes_ -= static_cast<int64_t>(idle_longest->bytes);
      evicted.push_back(idle_longest->base);
      blocks_.erase(idle_longest);
      ++stats_.freed;
    }
  }
  for (char* base : evicted) options_.free(base);
}

void CachingHostBufferPool::AddIdleLocked(Block* block, size_t offset,
                                          size_t length) {
  block->idle.emplace(offset, length);
  idle_by_size_.insert(
      IdleRange{length, reinterpret_cast<uintptr_t>(block->base + offset),
                block, offset});
  stats_.cached_bytes += static_cast<int64_t>(length);
}

void CachingHostBufferPool::RemoveIdleLocked(
    Block* block, std::map<size_t, size_t>::iterator range) {
  idle_by_size_.erase(IdleRange{
      range->second, reinterpret_cast<uintptr_t>(block->base + range->first),
      block, range->first});
  stats_.cached_bytes -= static_cast<int64_t>(range->second);
  block->idle.erase(range);
}

CachingHostBufferPool::Stats CachingHostBufferPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

int64_t CachingHostBufferPool::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

}  // namespace detlogp::server
