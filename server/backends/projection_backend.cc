#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/projection.h"
#include "server/backends/projection_backend.h"

namespace detlogp::server {

absl::Status CheckLaunch(int64_t rows, int64_t capacity,
                         absl::Span<const YDestination> outputs) {
  if (rows < 0 || rows > capacity) {
    return absl::InternalError(
        absl::StrCat("rows: ", rows, " outside staging's [0, ", capacity, "]"));
  }
  int64_t total = 0;
  for (const YDestination& output : outputs) {
    if (output.rows < 0 || (output.rows > 0 && output.y == nullptr)) {
      return absl::InternalError("outputs: a piece without a destination");
    }
    total += output.rows;
  }
  if (total != rows) {
    return absl::InternalError(absl::StrCat("outputs: pieces of ", total,
                                            " rows for a launch of ", rows));
  }
  return absl::OkStatus();
}

double CopyOutOfStaging(const float* y,
                        absl::Span<const YDestination> outputs) {
  const absl::Time start = absl::Now();
  for (const YDestination& output : outputs) {
    const size_t count = output.rows * kernels::kProjectionOutDim;
    std::memcpy(output.y, y, count * sizeof(float));
    y += count;
  }
  return absl::ToDoubleSeconds(absl::Now() - start);
}

}  // namespace detlogp::server
