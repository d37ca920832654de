#include "server/transport/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace detlogp::server {
namespace {

// Connects to the socket at `path` and returns 0 if some process accepts
// there, else connect's errno (ECONNREFUSED: nobody listens, a stale file).
int TryConnect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  const int result = ::connect(fd, reinterpret_cast<const sockaddr*>(&address),
                               sizeof(address)) == 0
                         ? 0
                         : errno;
  ::close(fd);
  return result;
}

}  // namespace

absl::Status PrepareUnixSocketPath(const std::string& path, const char* flag) {
  constexpr size_t kMaxPath = sizeof(sockaddr_un::sun_path) - 1;
  if (path.empty())
    return absl::InvalidArgumentError(absl::StrCat(flag, ": empty path"));
  if (path.size() > kMaxPath) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " is ", path.size(),
                     " bytes; a Unix socket path holds at most ", kMaxPath));
  }
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        flag, ": cannot inspect ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(info.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": ", path, " exists and is not a socket"));
  }
  const int connect_error = TryConnect(path);
  if (connect_error == 0) {
    return absl::AlreadyExistsError(
        absl::StrCat(flag, ": another process accepts connections on ", path));
  }
  if (connect_error != ECONNREFUSED) {  // e.g. no permission: maybe in use
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": cannot tell whether ", path,
                     " is in use: ", std::strerror(connect_error)));
  }
  if (::unlink(path.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": cannot remove the stale socket ", path, ": ",
                     std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string UnixSocketAddress(const std::string& path) {
  return absl::StrCat("unix:", path);
}

}  // namespace detlogp::server
