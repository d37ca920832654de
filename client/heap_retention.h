// Keeps freed heap memory in the process for reuse instead of returning it
// to the OS: what a process that receives large gRPC messages needs.
//
// gRPC reads a message off the socket into 64 KiB slices allocated with
// malloc and frees them all when the message is dropped. With glibc's
// default trim threshold (128 KiB) the freed top of the heap goes back to the
// OS at once, so the next message's recvmsg copies land on fresh pages: a
// page fault and a zeroed 4 KiB page for most received bytes. Measured on a
// projection stream (docs/performance.md, "H3 projection streaming"): 66 %
// of a 256-row stream's bytes and 84 % of a 2048-row one's arrived on fresh
// pages, which cost the reading thread more than the copy itself.
//
//   if (absl::Status s = RetainFreedHeapMemory(int64_t{256} << 20); !s.ok())
//   ...
//
// Process-wide (glibc's M_TRIM_THRESHOLD and M_ARENA_MAX), so only a
// program's main calls these, once, before threads start; a library never
// does.
#ifndef DETLOGP_CLIENT_HEAP_RETENTION_H_
#define DETLOGP_CLIENT_HEAP_RETENTION_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace detlogp::client {

// Lets malloc keep up to `bytes` free at the top of each of its heaps before
// giving memory back to the OS. Memory it keeps is reused by the next
// allocations; the bound is per malloc arena (a process of a few threads
// has a few). 0 leaves glibc's default. INVALID_ARGUMENT outside
// [0, 2 GiB - 1]; INTERNAL if malloc refuses the setting.
absl::Status RetainFreedHeapMemory(int64_t bytes);

// Caps glibc's malloc arenas at `arenas` (M_ARENA_MAX); 0 leaves glibc's
// default (8 per core). A thread that reads a stream allocates its receive
// slices in an arena of its own, and every arena but the main one grows in
// mapped heaps of at most 64 MiB, smaller than two 44 MB messages (our
// reading of why their pages came back fresh; not traced). One arena (the
// main heap, which the trim threshold above governs) measured 3-4 % faster with
// a fifth fewer page faults per GB on a four-call projection. Process-wide,
// in main, before threads
// start. INVALID_ARGUMENT when negative; INTERNAL if malloc refuses.
absl::Status LimitMallocArenas(int arenas);

// Transparent huge pages for malloc's heap (glibc >= 2.35's tunable
// glibc.malloc.hugetlb=1: madvise(MADV_HUGEPAGE) on what the heap grows
// by). Measured on a four-call projection of one video on the H200 host:
// page faults per GB of Y 24-26k -> 5k in a
// fresh process and 8-10k -> 0.5-0.7k in later runs, 4-14 % faster, and the
// fresh process's penalty for larger chunks gone (2048 / 1024 rows per chunk
// 0.95 -> 1.02 paired). glibc reads tunables only when a process starts, so
// a program sets GLIBC_TUNABLES and re-executes itself (client libraries
// leave it to the program). Returns GLIBC_TUNABLES'
// value with the tunable appended to `current` (null: unset), or nullopt when
// `current` already sets glibc.malloc.hugetlb: the caller's choice stands,
// and a re-executed program does not do it again.
std::optional<std::string> TunablesWithMallocHugePages(const char* current);

// The value `tunables` (GLIBC_TUNABLES' form, name=value pairs separated by
// colons; null: unset) gives glibc.malloc.hugetlb, or nullopt.
std::optional<std::string> MallocHugePagesTunable(const char* tunables);

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_HEAP_RETENTION_H_
