// Backends chosen by name, never by branches in the server: each kind of
// backend (log-prob, projection) has a registry of factories, filled once at
// start-up by RegisterBuiltinBackends.
#ifndef DETLOGP_SERVER_BACKENDS_BACKEND_REGISTRY_H_
#define DETLOGP_SERVER_BACKENDS_BACKEND_REGISTRY_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace detlogp::server {

// `Options` must have an `int device_index` member.
template <typename Backend, typename Options>
class BackendRegistry {
 public:
  using Factory =
      std::function<absl::StatusOr<std::unique_ptr<Backend>>(const Options&)>;

  void Register(std::string name, Factory factory) {
    factories_.emplace_back(std::move(name), std::move(factory));
  }

  std::vector<std::string> names() const {
    std::vector<std::string> names;
    for (const auto& entry : factories_) names.push_back(entry.first);
    return names;
  }

  // `device` is "auto", "<name>", "<name>:<index>" or "<name>:all" (e.g.
  // "cpu", "cuda:0", "cuda:all"); "all" passes device_index -1 (every
  // suitable device), "auto" -2 (the first suitable device). For "auto" the
  // first backend that starts wins, in registration order; why the others
  // did not is in `notes`.
  absl::StatusOr<std::unique_ptr<Backend>> Create(
      const std::string& device, Options options,
      std::vector<std::string>* notes) const {
    if (device == "auto") {
      for (const auto& [name, factory] : factories_) {
        options.device_index = -2;
        auto backend = factory(options);
        if (backend.ok()) return backend;
        notes->push_back(
            absl::StrCat(name, " unavailable: ", backend.status().message()));
      }
      return absl::UnavailableError(absl::StrCat("no backend could start: ",
                                                 absl::StrJoin(*notes, "; ")));
    }
    std::vector<std::string> parts = absl::StrSplit(device, ':');
    options.device_index = 0;
    if (parts.size() == 2 && parts[1] == "all") {
      options.device_index = -1;
    } else if (parts.size() > 2 ||
               (parts.size() == 2 &&
                (!absl::SimpleAtoi(parts[1], &options.device_index) ||
                 options.device_index < 0))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--device=", device, ": expected auto, cpu, cuda:N or cuda:all"));
    }
    for (const auto& [name, factory] : factories_) {
      if (name == parts[0]) return factory(options);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, ": this build has backends {",
                     absl::StrJoin(names(), ", "), "}"));
  }

 private:
  std::vector<std::pair<std::string, Factory>> factories_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_BACKENDS_BACKEND_REGISTRY_H_
