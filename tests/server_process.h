// Starts the real detlogp_server binary on a loopback port for integration
// tests, and stops it with a signal.
#ifndef DETLOGP_TESTS_SERVER_PROCESS_H_
#define DETLOGP_TESTS_SERVER_PROCESS_H_

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace detlogp::testing {

class ServerProcess {
 public:
  // Starts the server with `args` plus --port=0 and a port file, and waits
  // until it serves (or `timeout_s` passes).
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::vector<std::string>& args, int timeout_s = 120);
  ~ServerProcess();

  int port() const { return port_; }
  // Port of /metrics when started with --metrics_port=0, else 0.
  int metrics_port() const { return metrics_port_; }
  // GET http://<host>:<metrics_port>/<path> (host an IPv4 or IPv6 address);
  // the whole response (status line, headers, body), or an error.
  absl::StatusOr<std::string> HttpGet(
      const std::string& path, const std::string& host = "127.0.0.1") const;
  // The value of the unlabelled sample `name` on /metrics (e.g.
  // "detlogp_rows_computed_total"); -1 when it cannot be read.
  double MetricValue(const std::string& name) const;
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }

  // Sends `signal` and waits for exit; returns the exit code (or 128+signal).
  int Stop(int signal = SIGTERM);
  // Everything the server logged so far.
  std::string Log() const;

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string log_path_;
};

// Path of the server binary in the test's runfiles.
std::string ServerBinaryPath();
// Path of detlogp_cli in the test's runfiles (tests that run it depend on
// //client:detlogp_cli as data).
std::string CliBinaryPath();

// Runs detlogp_cli with `arguments` through the shell (add " 2>&1" to them
// to capture stderr too); returns its exit code and stdout.
std::pair<int, std::string> RunCli(const std::string& arguments);

}  // namespace detlogp::testing

#endif  // DETLOGP_TESTS_SERVER_PROCESS_H_
