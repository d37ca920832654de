#include "client/system_shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace detlogp::client {

std::string SystemSharedMemory::UniqueKey() {
  static std::atomic<int64_t> counter{0};
  // The pid alone is not unique: processes in other PID namespaces (each
  // container, each sandboxed test) share /dev/shm with the same pids.
  std::random_device entropy;
  return absl::StrCat("/detlogp_", getpid(), "_", counter.fetch_add(1), "_",
                      absl::Hex(entropy(), absl::kZeroPad8));
}

absl::StatusOr<std::unique_ptr<SystemSharedMemory>> SystemSharedMemory::Create(
    int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory: ", bytes, " bytes must be positive"));
  }
  std::string key = UniqueKey();
  // Owner-only: the server runs as the same user, other users read nothing.
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("shm_open ", key, ": ", std::strerror(errno)));
  }
  if (ftruncate(fd, bytes) != 0) {
    const int error = errno;
    close(fd);
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat(
        "ftruncate ", key, " to ", bytes, " bytes: ", std::strerror(error)));
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap ", key, ": ", std::strerror(error)));
  }
  return std::unique_ptr<SystemSharedMemory>(
      new SystemSharedMemory(std::move(key), static_cast<char*>(data), bytes));
}

void SystemSharedMemory::Unlink() {
  if (linked_) shm_unlink(key_.c_str());
  linked_ = false;
}

SystemSharedMemory::~SystemSharedMemory() {
  munmap(data_, bytes_);
  Unlink();
}

}  // namespace detlogp::client
