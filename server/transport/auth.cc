#include "server/transport/auth.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace detlogp::server {
namespace {

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    difference |= x ^ y;
  }
  return difference == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuthenticator>>
TokenAuthenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot read tokens file ", path));
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    const std::string token(absl::StripAsciiWhitespace(line));
    if (token.empty() || token[0] == '#') continue;
    tokens.push_back(token);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds no tokens"));
  }
  return FromTokens(std::move(tokens));
}

std::unique_ptr<TokenAuthenticator> TokenAuthenticator::FromTokens(
    std::vector<std::string> tokens) {
  return std::unique_ptr<TokenAuthenticator>(
      new TokenAuthenticator(std::move(tokens)));
}

std::string TokenAuthenticator::PresentedToken(
    const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  const absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kPrefix = "Bearer ";
  if (!absl::StartsWith(value, kPrefix)) return "";
  return std::string(value.substr(kPrefix.size()));
}

absl::Status TokenAuthenticator::Check(
    const grpc::CallbackServerContext& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "missing 'authorization: Bearer <token>'");
  }
  const std::string value(it->second.data(), it->second.size());
  constexpr absl::string_view kPrefix = "Bearer ";
  if (!absl::StartsWith(value, kPrefix)) {
    return absl::UnauthenticatedError("authorization is not a Bearer token");
  }
  const std::string presented = value.substr(kPrefix.size());
  bool known = false;
  for (const std::string& token : tokens_) {
    known |= ConstantTimeEquals(presented, token);
  }
  if (!known) return absl::UnauthenticatedError("unknown bearer token");
  return absl::OkStatus();
}

}  // namespace detlogp::server
