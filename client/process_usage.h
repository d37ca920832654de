// This process's CPU time (all threads) and minor page faults, for reports
// of what a transfer cost the receiving side: received bytes that land on
// fresh pages show up as page faults (client/heap_retention.h).
#ifndef DETLOGP_CLIENT_PROCESS_USAGE_H_
#define DETLOGP_CLIENT_PROCESS_USAGE_H_

#include <sys/resource.h>

#include <cstdint>

namespace detlogp::client {

struct ProcessUsage {
  double cpu_seconds = 0;
  int64_t minor_page_faults = 0;

  static ProcessUsage Now() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    auto secs = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
    return {secs(usage.ru_utime) + secs(usage.ru_stime), usage.ru_minflt};
  }
  ProcessUsage operator-(const ProcessUsage& o) const {
    return {cpu_seconds - o.cpu_seconds,
            minor_page_faults - o.minor_page_faults};
  }
};

}  // namespace detlogp::client

#endif  // DETLOGP_CLIENT_PROCESS_USAGE_H_
