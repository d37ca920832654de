// A POSIX shared-memory object of whole pages that a test maps read-write
// and then truncates, as a careless owner would: afterwards the CPU faults
// (SIGBUS) on any mapped page beyond the object's new end.
//
//   auto shm = TruncatableShm::Create(4);  // four pages
//   std::memcpy(shm->page(3), rows, bytes);
//   shm->TruncateToPages(1);  // reads of pages 1-3 now fault
#ifndef DETLOGP_TESTS_TRUNCATABLE_SHM_H_
#define DETLOGP_TESTS_TRUNCATABLE_SHM_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

namespace detlogp::testing {

class TruncatableShm {
 public:
  // An object of `pages` pages, mapped; null when the host refuses.
  static std::unique_ptr<TruncatableShm> Create(size_t pages) {
    static std::atomic<int> next{0};
    const std::string key = "/detlogp_truncatable_" + std::to_string(getpid()) +
                            "_" + std::to_string(next++);
    const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return nullptr;
    shm_unlink(key.c_str());  // the descriptor and the mapping keep it
    const size_t bytes = pages * PageBytes();
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      return nullptr;
    }
    void* data =
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      close(fd);
      return nullptr;
    }
    return std::unique_ptr<TruncatableShm>(
        new TruncatableShm(fd, static_cast<char*>(data), bytes));
  }

  ~TruncatableShm() {
    munmap(data_, bytes_);
    close(fd_);
  }
  TruncatableShm(const TruncatableShm&) = delete;
  TruncatableShm& operator=(const TruncatableShm&) = delete;

  static size_t PageBytes() { return static_cast<size_t>(getpagesize()); }
  char* data() const { return data_; }
  char* page(size_t index) const { return data_ + index * PageBytes(); }
  size_t bytes() const { return bytes_; }

  // Shrinks the object to its first `pages` pages; true on success.
  bool TruncateToPages(size_t pages) {
    return ftruncate(fd_, static_cast<off_t>(pages * PageBytes())) == 0;
  }

 private:
  TruncatableShm(int fd, char* data, size_t bytes)
      : fd_(fd), data_(data), bytes_(bytes) {}
  const int fd_;
  char* const data_;
  const size_t bytes_;
};

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_TRUNCATABLE_SHM_H_
