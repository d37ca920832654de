// A minimal HTTP/1.1 server for Prometheus scrapes: GET /metrics answers the
// text exposition format, anything else 404. One thread, one connection at a
// time (scrapes are rare and small). Listens on an IPv4 or IPv6 address.
//
// Not prometheus-cpp's pull Exposer: it serves through civetweb, and
// Debian 12's libcivetweb1 is built without IPv6 (mg_check_feature(8) is 0;
// Exposer("[::1]:0") throws "null context when constructing CivetServer"),
// so --host=::1 could not serve /metrics through it.
#ifndef DETLOGP_SERVER_OBSERVABILITY_METRICS_HTTP_SERVER_H_
#define DETLOGP_SERVER_OBSERVABILITY_METRICS_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace detlogp::server {

class MetricsHttpServer {
 public:
  struct Options {
    // An IPv4 or IPv6 address, without brackets ("127.0.0.1", "::1").
    std::string host = "127.0.0.1";
    int port = 0;  // 0 picks a free port
    // Produces the body of GET /metrics.
    std::function<std::string()> render;
  };

  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const Options& options);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void ServeLoop();
  void HandleConnection(int fd);

  Options options_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_OBSERVABILITY_METRICS_HTTP_SERVER_H_
