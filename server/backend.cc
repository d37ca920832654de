#include "server/backend.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace detlogp::server {

void BackendRegistry::Register(std::string name, Factory factory) {
  factories_.emplace_back(std::move(name), std::move(factory));
}

std::vector<std::string> BackendRegistry::names() const {
  std::vector<std::string> names;
  for (const auto& [name, factory] : factories_) names.push_back(name);
  return names;
}

absl::StatusOr<std::unique_ptr<LogpBackend>> BackendRegistry::Create(
    const std::string& device, BackendOptions options,
    std::vector<std::string>* notes) const {
  if (device == "auto") {
    for (const auto& [name, factory] : factories_) {
      options.device_index = 0;
      auto backend = factory(options);
      if (backend.ok()) return backend;
      notes->push_back(absl::StrCat(name, " unavailable: ",
                                    backend.status().message()));
    }
    return absl::UnavailableError("no backend could start");
  }
  std::vector<std::string> parts = absl::StrSplit(device, ':');
  const std::string& name = parts[0];
  options.device_index = 0;
  if (parts.size() == 2 && !absl::SimpleAtoi(parts[1], &options.device_index)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, ": bad device index"));
  }
  if (parts.size() > 2 || options.device_index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, ": expected auto, cpu or cuda:N"));
  }
  for (const auto& [registered, factory] : factories_) {
    if (registered == name) return factory(options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device=", device, ": this build has backends {",
                   absl::StrJoin(names(), ", "), "}"));
}

}  // namespace detlogp::server
