// Reads from a mapping of a shared-memory object another process owns and
// may truncate at any time (a system region's mapping). Once the owner
// ftruncate()s the object below a mapped page, a CPU read of that page
// raises SIGBUS, whose default action kills the whole server. A guarded
// read returns a status instead; the server answers the one request that
// named the region and goes on serving everyone else.
//
// Example:
//   absl::Status read = CopyFromMapping(staging, lease->data(), bytes);
//   if (!read.ok()) return RegionShrankError("hidden.shared_memory", name);
//
// How: a SIGBUS handler, installed once for the process on the first guarded
// read, jumps (siglongjmp) back into the guarded read of the thread that
// faulted when the fault lies in that read's source bytes. Any other SIGBUS
// goes to the handler that was installed before, or gets the default action
// (the process dies as it would have without this library).
#ifndef DETLOGP_SERVER_SHARED_MEMORY_MAPPED_READS_H_
#define DETLOGP_SERVER_SHARED_MEMORY_MAPPED_READS_H_

#include <cstddef>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace detlogp::server {

// Copies `bytes` bytes from `src` (inside a mapping its owner may truncate)
// to `dst` (ordinary memory). FAILED_PRECONDITION when a page of the source
// vanished under the copy; `dst` then holds some of the bytes.
absl::Status CopyFromMapping(void* dst, const void* src, size_t bytes);

// Runs `read`, which reads at most the `bytes` bytes at `src` (inside a
// mapping its owner may truncate), under the same guard as CopyFromMapping.
// `read` is abandoned mid-way when a page vanishes: it must allocate
// nothing, take no lock and leave nothing half-done that outlives it (it
// writes only memory the caller owns and treats as garbage on failure).
absl::Status ReadFromMapping(const void* src, size_t bytes,
                             absl::FunctionRef<void()> read);

// What a request is told when the region `region` it names shrank under it,
// naming `field`. FAILED_PRECONDITION: the request was valid when accepted
// (not INVALID_ARGUMENT); the region's state no longer allows it, and the
// caller can fix that (register the object again) before retrying. Not
// DATA_LOSS, which says the server lost or corrupted data: the server's
// state is intact and nothing it holds was lost.
absl::Status RegionShrankError(absl::string_view field,
                               absl::string_view region);

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_SHARED_MEMORY_MAPPED_READS_H_
