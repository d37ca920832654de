#include "client/heap_retention.h"

#include <malloc.h>

#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace detlogp::client {

absl::Status RetainFreedHeapMemory(int64_t bytes) {
  if (bytes < 0 || bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heap retention: ", bytes, " bytes is outside [0, ",
        std::numeric_limits<int>::max(), "]"));
  }
  if (bytes == 0) return absl::OkStatus();
  // mallopt returns 1 on success. Setting the trim threshold also freezes
  // glibc's mmap threshold at its default (128 KiB): blocks that large are
  // still mapped and unmapped one by one, which is fine here (gRPC's receive
  // slices are 64 KiB; the large buffers of a stream are reused).
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(bytes)) != 1) {
    return absl::InternalError(
        absl::StrCat("heap retention: mallopt(M_TRIM_THRESHOLD, ", bytes, ") failed"));
  }
  return absl::OkStatus();
}

absl::Status LimitMallocArenas(int arenas) {
  if (arenas < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("malloc arenas: ", arenas, " is negative"));
  }
  if (arenas == 0) return absl::OkStatus();
  if (mallopt(M_ARENA_MAX, arenas) != 1) {
    return absl::InternalError(
        absl::StrCat("malloc arenas: mallopt(M_ARENA_MAX, ", arenas, ") failed"));
  }
  return absl::OkStatus();
}

std::optional<std::string> TunablesWithMallocHugePages(const char* current) {
  constexpr char kName[] = "glibc.malloc.hugetlb";
  const absl::string_view tunables = current == nullptr ? "" : current;
  // name=value pairs separated by colons.
  for (absl::string_view pair : absl::StrSplit(tunables, ':', absl::SkipEmpty())) {
    if (absl::StartsWith(pair, absl::StrCat(kName, "="))) return std::nullopt;
  }
  if (tunables.empty()) return absl::StrCat(kName, "=1");
  return absl::StrCat(tunables, ":", kName, "=1");
}

}  // namespace detlogp::client
