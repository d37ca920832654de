// A POSIX shared-memory object this process creates and maps read-write,
// for the server to map once (SharedMemoryService) and read rows from.
//
//   auto shm = SystemSharedMemory::Create(1 << 20);
//   std::memcpy((*shm)->data(), rows, bytes);
//   // register (*shm)->key() with the server, then:
//   (*shm)->Unlink();  // the name goes; both mappings stay valid
//
// Unlinking right after registration means a process killed with -9 leaves
// no object behind in /dev/shm: the memory lives on only in the server's
// mapping, which the server releases after --shared_memory_idle_s.
#ifndef DETLOGP_CLIENT_SYSTEM_SHARED_MEMORY_H_
#define DETLOGP_CLIENT_SYSTEM_SHARED_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace detlogp::client {

class SystemSharedMemory {
 public:
  // A new object of `bytes` bytes (> 0) named UniqueKey().
  static absl::StatusOr<std::unique_ptr<SystemSharedMemory>> Create(
      int64_t bytes);
  // Unmaps, and unlinks the name unless Unlink() did.
  ~SystemSharedMemory();
  SystemSharedMemory(const SystemSharedMemory&) = delete;
  SystemSharedMemory& operator=(const SystemSharedMemory&) = delete;

  char* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  // The shm_open name, "/detlogp_<pid>_<n>".
  const std::string& key() const { return key_; }
  // Removes the name; the mapping stays valid.
  void Unlink();

  // A name no other object of this process has, "/detlogp_<pid>_<n>".
  static std::string UniqueKey();

 private:
  SystemSharedMemory(std::string key, char* data, int64_t bytes)
      : key_(std::move(key)), data_(data), bytes_(bytes) {}
  const std::string key_;
  char* const data_;
  const int64_t bytes_;
  bool linked_ = true;
};

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_SYSTEM_SHARED_MEMORY_H_
