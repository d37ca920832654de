#include "client/heap_retention.h"

#include <malloc.h>

#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace detlogp::client {

absl::Status RetainFreedHeapMemory(int64_t bytes) {
  if (bytes < 0 || bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("heap retention: ", bytes, " bytes is outside [0, ",
                     std::numeric_limits<int>::max(), "]"));
  }
  if (bytes == 0) return absl::OkStatus();
  // mallopt returns 1 on success. Setting the trim threshold also freezes
  // glibc's mmap threshold at its default (128 KiB): blocks that large are
  // still mapped and unmapped one by one, which is fine here (gRPC's receive
  // slices are 64 KiB; the large buffers of a stream are reused).
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(bytes)) != 1) {
    return absl::InternalError(absl::StrCat(
        "heap retention: mallopt(M_TRIM_THRESHOLD, ", bytes, ") failed"));
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
    return absl::InternalError(absl::StrCat(
        "malloc arenas: mallopt(M_ARENA_MAX, ", arenas, ") failed"));
  }
  return absl::OkStatus();
}

namespace {
constexpr char kHugePagesTunable[] = "glibc.malloc.hugetlb";
}  // namespace

std::optional<std::string> MallocHugePagesTunable(const char* tunables) {
  if (tunables == nullptr) return std::nullopt;
  const std::string prefix = absl::StrCat(kHugePagesTunable, "=");
  for (absl::string_view pair :
       absl::StrSplit(tunables, ':', absl::SkipEmpty())) {
    if (absl::StartsWith(pair, prefix))
      return std::string(pair.substr(prefix.size()));
  }
  return std::nullopt;
}

std::optional<std::string> TunablesWithMallocHugePages(const char* current) {
  if (MallocHugePagesTunable(current).has_value()) return std::nullopt;
  const absl::string_view tunables = current == nullptr ? "" : current;
  if (tunables.empty()) return absl::StrCat(kHugePagesTunable, "=1");
  return absl::StrCat(tunables, ":", kHugePagesTunable, "=1");
}

}  // namespace detlogp::client
