#include "server/observability/metrics_http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace detlogp::server {

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const Options& options) {
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->options_ = options;
  // An IPv4 or IPv6 address ("127.0.0.1", "::1", "0.0.0.0", "::"), as gRPC's
  // --host takes it; "::" also accepts IPv4 unless the system says v6only.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(options.host.c_str(), std::to_string(options.port).c_str(),
                  &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics: ", options.host, " is not an IPv4 or IPv6 address"));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> address(found, freeaddrinfo);
  const std::string where = absl::StrCat(
      address->ai_family == AF_INET6 ? absl::StrCat("[", options.host, "]")
                                     : options.host,
      ":", options.port);
  server->listen_fd_ = socket(address->ai_family, SOCK_STREAM | SOCK_CLOEXEC,
                              address->ai_protocol);
  if (server->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat(
        "metrics: cannot listen on ", where, ": ", std::strerror(errno)));
  }
  const int one = 1;
  if (setsockopt(server->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one,
                 sizeof(one)) != 0 ||
      bind(server->listen_fd_, address->ai_addr, address->ai_addrlen) != 0 ||
      listen(server->listen_fd_, 16) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "metrics: cannot listen on ", where, ": ", std::strerror(errno)));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  if (getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&bound),
                  &length) != 0) {
    return absl::InternalError(
        absl::StrCat("metrics: getsockname: ", std::strerror(errno)));
  }
  server->port_ = ntohs(bound.ss_family == AF_INET6
                            ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  server->thread_ = std::thread([s = server.get()] { s->ServeLoop(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

void MetricsHttpServer::ServeLoop() {
  while (!stopping_) {
    pollfd ready{listen_fd_, POLLIN, 0};
    if (poll(&ready, 1, 200) <= 0) continue;  // wakes to check stopping_
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    HandleConnection(fd);
    close(fd);
  }
}

void MetricsHttpServer::HandleConnection(int fd) {
  // Read the request head (bounded in size and time).
  std::string request;
  char buffer[2048];
  while (request.size() < 16384 &&
         request.find("\r\n\r\n") == std::string::npos) {
    pollfd ready{fd, POLLIN, 0};
    if (poll(&ready, 1, 2000) <= 0) return;
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n <= 0) return;
    request.append(buffer, n);
  }
  std::string status = "404 Not Found";
  std::string body = "not found; try /metrics\n";
  std::string type = "text/plain";
  if (absl::StartsWith(request, "GET /metrics ") ||
      absl::StartsWith(request, "GET /metrics?")) {
    status = "200 OK";
    body = options_.render();
    type = "text/plain; version=0.0.4; charset=utf-8";
  }
  const std::string response =
      absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                   "\r\nContent-Length: ", body.size(),
                   "\r\nConnection: close\r\n\r\n", body);
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t n = write(fd, response.data() + sent, response.size() - sent);
    if (n <= 0) return;
    sent += n;
  }
}

}  // namespace detlogp::server
