// Keeps freed heap memory in the process for reuse instead of returning it
// to the OS: what a process that receives large gRPC messages needs.
//
// gRPC reads a message off the socket into 64 KiB slices allocated with
// malloc and frees them all when the message is dropped. With glibc's
// default trim threshold (128 KiB) the freed top of the heap goes back to the
// OS at once, so the next message's recvmsg copies land on fresh pages: a
// page fault and a zeroed 4 KiB page for most received bytes. Measured on a
// projection stream (docs/perf.md, H3 projection streaming, session 5): 66 %
// of a 256-row stream's bytes and 84 % of a 2048-row one's arrived on fresh
// pages, which cost the reading thread more than the copy itself.
//
//   if (absl::Status s = RetainFreedHeapMemory(int64_t{256} << 20); !s.ok()) ...
//
// Process-wide (it sets glibc's M_TRIM_THRESHOLD), so only a program's main
// calls it, once, before threads start; a library never does.
#ifndef DETLOGP_CLIENT_HEAP_RETENTION_H_
#define DETLOGP_CLIENT_HEAP_RETENTION_H_

#include <cstdint>

#include "absl/status/status.h"

namespace detlogp::client {

// Lets malloc keep up to `bytes` free at the top of each of its heaps before
// giving memory back to the OS. Memory it keeps is reused by the next
// allocations; the bound is per malloc arena (a process of a few threads
// has a few). 0 leaves glibc's default. INVALID_ARGUMENT outside
// [0, 2 GiB - 1]; INTERNAL if malloc refuses the setting.
absl::Status RetainFreedHeapMemory(int64_t bytes);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_HEAP_RETENTION_H_
