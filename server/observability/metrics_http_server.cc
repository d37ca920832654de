#include "server/observability/metrics_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace detlogp::server {

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const Options& options) {
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->options_ = options;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(options.port));
  if (inet_pton(AF_INET, options.host.c_str(), &address.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: ", options.host, " is not an IPv4 address"));
  }
  server->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(server->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&address),
           sizeof(address)) != 0 ||
      listen(server->listen_fd_, 16) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "metrics: cannot listen on ", options.host, ":", options.port, ": ",
        std::strerror(errno)));
  }
  socklen_t length = sizeof(address);
  getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&address), &length);
  server->port_ = ntohs(address.sin_port);
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
  while (request.size() < 16384 && request.find("\r\n\r\n") == std::string::npos) {
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
