#include "tests/server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace detlogp::testing {

std::string ServerBinaryPath() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return absl::StrCat(srcdir != nullptr ? srcdir : ".",
                      "/detlogp/server/detlogp_server");
}

std::string CliBinaryPath() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return absl::StrCat(srcdir != nullptr ? srcdir : ".",
                      "/detlogp/client/detlogp_cli");
}

std::pair<int, std::string> RunCli(const std::string& arguments) {
  const std::string command = CliBinaryPath() + " " + arguments;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0)
    output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::vector<std::string>& args, int timeout_s) {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string base = absl::StrCat(tmp != nullptr ? tmp : "/tmp",
                                        "/server_", getpid(), "_", counter++);
  const std::string port_file = base + ".port";
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->log_path_ = base + ".log";
  std::vector<std::string> argv_strings = {ServerBinaryPath(), "--port=0",
                                           "--port_file=" + port_file};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    const int fd =
        open(server->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  server->pid_ = pid;
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  while (absl::Now() < deadline) {
    std::ifstream in(port_file);
    if (in >> server->port_ >> server->metrics_port_ && server->port_ > 0) {
      return server;
    }
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      server->pid_ = -1;
      return absl::InternalError(
          absl::StrCat("server exited during start-up:\n", server->Log()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError("server did not start in time");
}

double ServerProcess::MetricValue(const std::string& name) const {
  auto text = HttpGet("/metrics");
  if (!text.ok()) return -1;
  const std::string series = "\n" + name + " ";
  const size_t at = text->find(series);
  return at == std::string::npos ? -1
                                 : std::stod(text->substr(at + series.size()));
}

absl::StatusOr<std::string> ServerProcess::HttpGet(
    const std::string& path, const std::string& host) const {
  if (metrics_port_ <= 0)
    return absl::FailedPreconditionError("no metrics port");
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(metrics_port_).c_str(), &hints,
                  &found) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(host, " is not an IP address"));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM, 0);
  const bool connected =
      fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0;
  freeaddrinfo(found);
  if (!connected) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError("cannot connect to the metrics port");
  }
  const std::string request =
      "GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n";
  if (write(fd, request.data(), request.size()) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("short write");
  }
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  close(fd);
  return response;
}

int ServerProcess::Stop(int signal) {
  if (pid_ < 0) return -1;
  kill(pid_, signal);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

std::string ServerProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) Stop(SIGKILL);
}

}  // namespace detlogp::testing
