#include "server/models/model_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "proto/status_details.h"

namespace detlogp::server {

// Bytes reserved or held by placed versions. Shared with the deleters of
// placed weights, which may run after the manager is gone.
class ModelManager::Tracker {
 public:
  explicit Tracker(int64_t limit) : limit_(limit) {}

  absl::Status Reserve(int64_t bytes) {
    absl::MutexLock lock(&mu_);
    if (limit_ > 0 && used_ + bytes > limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "model memory: ", used_, " bytes held + ", bytes,
          " for the new version > --max_model_memory_bytes=", limit_,
          "; unload a version first"));
    }
    used_ += bytes;
    return absl::OkStatus();
  }
  void Release(int64_t bytes) {
    absl::MutexLock lock(&mu_);
    used_ -= bytes;
  }
  int64_t used() const {
    absl::MutexLock lock(&mu_);
    return used_;
  }

 private:
  const int64_t limit_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

ModelManager::Reservation& ModelManager::Reservation::operator=(
    Reservation&& other) noexcept {
  if (this != &other) {
    if (tracker_ != nullptr) tracker_->Release(bytes_);
    tracker_ = std::move(other.tracker_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

ModelManager::Reservation::~Reservation() {
  if (tracker_ != nullptr) tracker_->Release(bytes_);
}

absl::StatusOr<std::unique_ptr<ModelManager>> ModelManager::Create(
    Options options) {
  if (options.max_versions_per_model < 1) {
    return absl::InvalidArgumentError("--max_versions_per_model must be >= 1");
  }
  if (options.staged_timeout <= absl::ZeroDuration() ||
      options.staged_sweep_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--staged_version_timeout_s must be > 0");
  }
  if (options.max_model_memory_bytes < 0) {
    return absl::InvalidArgumentError("--max_model_memory_bytes must be >= 0");
  }
  if (!options.place || !options.estimate_bytes || !options.warm_up ||
      !options.now) {
    return absl::InvalidArgumentError(
        "model manager: place, estimate_bytes, warm_up and now are "
        "required");
  }
  if (absl::Status s =
          ValidateModelName(options.default_model, "--default_model");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<ModelManager>(new ModelManager(std::move(options)));
}

ModelManager::ModelManager(Options options)
    : options_(std::move(options)),
      tracker_(std::make_shared<Tracker>(options_.max_model_memory_bytes)) {
  sweeper_ = std::thread([this] { SweepLoop(); });
}

ModelManager::~ModelManager() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  sweeper_.join();
}

absl::StatusOr<std::shared_ptr<const ServedVersion>> ModelManager::Resolve(
    absl::string_view model, int64_t version) const {
  const std::string name(model.empty() ? options_.default_model : model);
  absl::ReaderMutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end() || it->second.ready.empty()) {
    return v1::FieldError(absl::StatusCode::kNotFound, "model",
                          absl::StrCat("no model '", name, "' is loaded"),
                          v1::kReasonModelNotFound);
  }
  const Model& m = it->second;
  if (version == 0) return m.ready.rbegin()->second;
  auto v = m.ready.find(version);
  if (v == m.ready.end()) {
    return v1::FieldError(
        absl::StatusCode::kNotFound, "model_version",
        absl::StrCat("model '", name, "' has no ready version ", version,
                     " (ready: ", m.ready.begin()->first, "..",
                     m.ready.rbegin()->first, ")"),
        v1::kReasonVersionUnavailable);
  }
  return v->second;
}

absl::StatusOr<ModelManager::Reservation> ModelManager::Reserve(
    int64_t hidden_size, int64_t padded_vocab_size, bool has_bias) {
  const int64_t bytes =
      options_.estimate_bytes(hidden_size, padded_vocab_size, has_bias);
  if (absl::Status s = tracker_->Reserve(bytes); !s.ok()) return s;
  Reservation reservation;
  reservation.tracker_ = tracker_;
  reservation.bytes_ = bytes;
  return reservation;
}

absl::StatusOr<detlogp::v1::ModelVersionStatus> ModelManager::AddVersion(
    const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
    VersionOrigin origin) {
  return AddVersion(model, std::move(weights), std::move(origin),
                    Reservation());
}

absl::StatusOr<std::shared_ptr<ServedVersion>> ModelManager::Prepare(
    const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
    const VersionOrigin& origin, Reservation reservation) {
  if (absl::Status s = ValidateModelName(model, "model"); !s.ok()) return s;
  if (absl::Status s = CheckVersionNumber(model, origin.version); !s.ok())
    return s;
  if (absl::Status s =
          CheckShape(model, weights->hidden_size, weights->vocab_size);
      !s.ok()) {
    return s;
  }
  if (reservation.tracker_ == nullptr) {
    auto reserved = Reserve(weights->hidden_size, weights->padded_vocab_size,
                            !weights->bias.empty());
    if (!reserved.ok()) return reserved.status();
    reservation = *std::move(reserved);
  }
  const absl::Time place_start = absl::Now();
  auto placed = options_.place(weights);
  const absl::Duration place_time = absl::Now() - place_start;
  if (!placed.ok()) {
    return absl::Status(
        placed.status().code(),
        absl::StrCat("placing the weights: ", placed.status().message()));
  }
  // The reservation now belongs to the placed weights: released when the
  // last request holding them is answered.
  const LogpModel* raw_placed = placed->get();
  std::shared_ptr<const LogpModel> tracked(
      raw_placed,
      [held = *std::move(placed), tracker = reservation.tracker_,
       bytes = std::exchange(reservation.bytes_, 0)](const LogpModel*) mutable {
        held.reset();
        tracker->Release(bytes);
      });

  auto version = std::make_shared<ServedVersion>();
  version->model = model;
  version->weights_sha256 = weights->sha256;
  digests::DeterminismInputs key_inputs = options_.key_inputs;
  key_inputs.weights_sha256 = weights->sha256;
  version->determinism_key = digests::DeterminismKey(key_inputs);
  version->hidden_size = weights->hidden_size;
  version->vocab_size = weights->vocab_size;
  version->padded_vocab_size = weights->padded_vocab_size;
  version->has_bias = !weights->bias.empty();
  version->memory_bytes = options_.estimate_bytes(
      weights->hidden_size, weights->padded_vocab_size, version->has_bias);
  version->source = origin.description;
  version->placed = std::move(tracked);
  version->host_weights = weights;
  weights.reset();  // backends that keep host weights hold their own reference

  const absl::Time warm_start = absl::Now();
  absl::Status warmed = options_.warm_up(*version);
  const absl::Duration warm_time = absl::Now() - warm_start;
  if (absl::Status s = std::move(warmed); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("warm-up: ", s.message()));
  }
  {
    absl::MutexLock lock(&mu_);
    // Again: a version of another shape may have been published meanwhile.
    if (absl::Status s =
            CheckShapeLocked(model, version->hidden_size, version->vocab_size);
        !s.ok()) {
      return s;
    }
    Model& m = models_[model];
    if (origin.version == 0) {
      version->version = m.next_version++;
    } else if (origin.version < m.next_version) {
      // Another version took the number while this one was placed.
      return VersionTaken(model, origin.version, m.next_version);
    } else {
      version->version = origin.version;
      m.next_version = origin.version + 1;
    }
  }
  spdlog::info(
      "model {} version {} prepared ({}; weights {}, key {}; placed in {:.3f} "
      "s, warmed up in {:.3f} s)",
      model, version->version, version->source, version->weights_sha256,
      version->determinism_key, absl::ToDoubleSeconds(place_time),
      absl::ToDoubleSeconds(warm_time));
  return version;
}

absl::StatusOr<detlogp::v1::ModelVersionStatus> ModelManager::AddVersion(
    const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
    VersionOrigin origin, Reservation reservation) {
  auto version =
      Prepare(model, std::move(weights), origin, std::move(reservation));
  if (!version.ok()) return version.status();
  if (origin.persist) {
    absl::Status s = origin.persist((*version)->version);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("persisting: ", s.message()));
    }
    (*version)->persisted =
        options_.store != nullptr && options_.store->writable();
  }
  (*version)->persisted = (*version)->persisted || origin.on_disk;
  return Publish(*std::move(version));
}

detlogp::v1::ModelVersionStatus ModelManager::Publish(
    std::shared_ptr<ServedVersion> version) {
  std::vector<int64_t> retired;
  detlogp::v1::ModelVersionStatus status;
  {
    absl::MutexLock lock(&mu_);
    version->ready_since = absl::Now();
    status = StatusOf(*version, detlogp::v1::ModelVersionStatus::READY);
    Model& m = models_[version->model];
    m.ready[version->version] = version;
    while (static_cast<int>(m.ready.size()) > options_.max_versions_per_model) {
      retired.push_back(m.ready.begin()->first);
      RetireLocked(version->model, m, retired.back());
    }
  }
  RemoveFiles(version->model, retired);
  spdlog::info("model {} version {} ready (weights {})", version->model,
               version->version, version->weights_sha256);
  return status;
}

absl::StatusOr<detlogp::v1::ModelVersionStatus> ModelManager::StageVersion(
    const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
    VersionOrigin origin, Reservation reservation) {
  if (origin.version <= 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "model_version",
                          "a staged version names its number (> 0), which "
                          "its commit names again");
  }
  auto version =
      Prepare(model, std::move(weights), origin, std::move(reservation));
  if (!version.ok()) return version.status();
  absl::MutexLock lock(&mu_);
  Staged& staged = models_[model].staged[(*version)->version];
  staged.version = *version;
  staged.persist = std::move(origin.persist);
  staged.on_disk = origin.on_disk;
  staged.staged_at = options_.now();
  return StatusOf(**version, detlogp::v1::ModelVersionStatus::STAGED);
}

absl::StatusOr<detlogp::v1::ModelVersionStatus> ModelManager::CommitVersion(
    const std::string& model, int64_t version,
    const std::string& weights_sha256) {
  if (absl::Status s = ValidateModelName(model, "model"); !s.ok()) return s;
  if (version <= 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "model_version",
                          "name the staged version to commit (> 0)");
  }
  Staged staged;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(model);
    if (it != models_.end()) {
      Model& m = it->second;
      auto s = m.staged.find(version);
      if (s == m.staged.end()) {
        auto ready = m.ready.find(version);
        if (ready != m.ready.end() &&
            (weights_sha256.empty() ||
             ready->second->weights_sha256 == weights_sha256)) {
          return StatusOf(
              *ready->second,
              detlogp::v1::ModelVersionStatus::READY);  // committed before
        }
      } else if (!weights_sha256.empty() &&
                 s->second.version->weights_sha256 != weights_sha256) {
        return v1::FieldError(
            absl::StatusCode::kFailedPrecondition, "weights_sha256",
            absl::StrCat("staged version ", version, " of '", model,
                         "' holds weights ", s->second.version->weights_sha256),
            v1::kReasonWeightsMismatch);
      } else {
        staged = std::move(s->second);
        m.staged.erase(s);
      }
    }
  }
  if (staged.version == nullptr) {
    return v1::FieldError(
        absl::StatusCode::kNotFound, "model_version",
        absl::StrCat("model '", model, "' has no staged version ", version,
                     " (never staged here, aborted, or dropped after "
                     "--staged_version_timeout_s)"),
        v1::kReasonVersionUnavailable);
  }
  auto ready = std::make_shared<ServedVersion>(*staged.version);
  staged.version.reset();
  if (staged.persist) {
    absl::Status s = staged.persist(version);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("persisting: ", s.message()));
    }
    ready->persisted = options_.store != nullptr && options_.store->writable();
  }
  ready->persisted = ready->persisted || staged.on_disk;
  return Publish(std::move(ready));
}

absl::Status ModelManager::AbortVersion(const std::string& model,
                                        int64_t version) {
  if (absl::Status s = ValidateModelName(model, "model"); !s.ok()) return s;
  Staged dropped;  // freed outside mu_ (its files with it)
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return absl::OkStatus();
  auto s = it->second.staged.find(version);
  if (s != it->second.staged.end()) {
    dropped = std::move(s->second);
    it->second.staged.erase(s);
    GiveBackNumberLocked(it->second, version);
    spdlog::info("model {} version {}: staged version aborted", model, version);
    return absl::OkStatus();
  }
  if (it->second.ready.count(version) > 0) {
    return v1::FieldError(absl::StatusCode::kFailedPrecondition,
                          "model_version",
                          absl::StrCat("version ", version, " of '", model,
                                       "' was committed; unload it instead"),
                          v1::kReasonVersionUnavailable);
  }
  return absl::OkStatus();
}

void ModelManager::GiveBackNumberLocked(Model& model, int64_t version) {
  // Only the newest number, and only while nothing above it was taken: a
  // push aborted everywhere then leaves every replica numbering as before,
  // so the next push (one above the highest number any replica lists) is
  // accepted by all.
  if (model.next_version == version + 1) model.next_version = version;
}

int ModelManager::DropExpiredStaged(absl::Time now) {
  std::vector<Staged> dropped;  // freed outside mu_
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, model] : models_) {
      for (auto it = model.staged.begin(); it != model.staged.end();) {
        if (now - it->second.staged_at < options_.staged_timeout) {
          ++it;
          continue;
        }
        spdlog::warn(
            "model {} version {}: staged {:.3f} s ago and not committed; "
            "dropped",
            name, it->first, absl::ToDoubleSeconds(now - it->second.staged_at));
        dropped.push_back(std::move(it->second));
        const int64_t number = it->first;
        it = model.staged.erase(it);
        GiveBackNumberLocked(model, number);
      }
    }
  }
  return static_cast<int>(dropped.size());
}

void ModelManager::SweepLoop() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(this, &ModelManager::Stopping),
                               options_.staged_sweep_interval)) {
    mu_.Unlock();
    DropExpiredStaged(options_.now());
    mu_.Lock();
  }
}

absl::Status ModelManager::VersionTaken(const std::string& model, int64_t asked,
                                        int64_t next) {
  return v1::FieldError(
      absl::StatusCode::kFailedPrecondition, "model_version",
      absl::StrCat("model '", model, "' has had versions up to ", next - 1,
                   "; a new one must be numbered above (asked ", asked, ")"),
      v1::kReasonVersionUnavailable);
}

absl::Status ModelManager::CheckVersionNumber(const std::string& model,
                                              int64_t version) const {
  if (version < 0) {
    return v1::FieldError(
        absl::StatusCode::kInvalidArgument, "model_version",
        absl::StrCat(version, " is negative (0 means the next number)"));
  }
  if (version == 0) return absl::OkStatus();
  const int64_t next = NextVersion(model);
  return version >= next ? absl::OkStatus()
                         : VersionTaken(model, version, next);
}

absl::Status ModelManager::CheckShape(const std::string& model,
                                      int64_t hidden_size,
                                      int64_t vocab_size) const {
  absl::ReaderMutexLock lock(&mu_);
  return CheckShapeLocked(model, hidden_size, vocab_size);
}

absl::Status ModelManager::CheckShapeLocked(const std::string& model,
                                            int64_t hidden_size,
                                            int64_t vocab_size) const {
  auto it = models_.find(model);
  if (it == models_.end() || it->second.ready.empty()) return absl::OkStatus();
  const ServedVersion& latest = *it->second.ready.rbegin()->second;
  const auto refuse = [&](absl::string_view field, int64_t served,
                          int64_t offered) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": model '", model, "' serves ", field, "=", served,
        " (version ", latest.version, ") and the new version has ", field, "=",
        offered,
        "; a model keeps its shape across versions (unload every version, "
        "then load the new shape under its name)"));
  };
  if (hidden_size != latest.hidden_size) {
    return refuse("hidden_size", latest.hidden_size, hidden_size);
  }
  if (vocab_size != latest.vocab_size) {
    return refuse("vocab_size", latest.vocab_size, vocab_size);
  }
  return absl::OkStatus();
}

void ModelManager::RetireLocked(const std::string& name, Model& model,
                                int64_t version) {
  auto it = model.ready.find(version);
  if (it == model.ready.end()) return;
  spdlog::info(
      "model {} version {} unloading (new requests refused; {} in flight)",
      name, version, it->second.use_count() - 1);
  unloading_.erase(
      std::remove_if(unloading_.begin(), unloading_.end(),
                     [](const Unloading& u) { return u.handle.expired(); }),
      unloading_.end());
  unloading_.push_back(Unloading{name, version, it->second});
  model.ready.erase(it);
}

void ModelManager::RemoveFiles(const std::string& name,
                               const std::vector<int64_t>& versions) {
  if (options_.store == nullptr) return;
  for (int64_t version : versions) {
    if (absl::Status s = options_.store->Remove(name, version); !s.ok()) {
      spdlog::warn("model {} version {}: could not remove its files: {}", name,
                   version, std::string(s.message()));
    }
  }
}

absl::Status ModelManager::Unload(const std::string& model, int64_t version) {
  if (absl::Status s = ValidateModelName(model, "model"); !s.ok()) return s;
  if (version <= 0) {
    return v1::FieldError(absl::StatusCode::kInvalidArgument, "model_version",
                          "name the version to unload (> 0)");
  }
  std::weak_ptr<const ServedVersion> watched;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(model);
    if (it == models_.end()) {
      return v1::FieldError(absl::StatusCode::kNotFound, "model",
                            absl::StrCat("no model '", model, "' is loaded"),
                            v1::kReasonModelNotFound);
    }
    auto v = it->second.ready.find(version);
    if (v == it->second.ready.end()) {
      return v1::FieldError(
          absl::StatusCode::kNotFound, "model_version",
          absl::StrCat("model '", model, "' has no ready version ", version),
          v1::kReasonVersionUnavailable);
    }
    if (model == options_.default_model && it->second.ready.size() == 1) {
      // Requests without a model would all fail while health says SERVING.
      return v1::FieldError(
          absl::StatusCode::kFailedPrecondition, "model_version",
          absl::StrCat(version,
                       " is the default model's only ready version; "
                       "publish another before unloading it"),
          v1::kReasonVersionUnavailable);
    }
    watched = v->second;
    RetireLocked(model, it->second, version);
  }
  RemoveFiles(model, {version});
  // Requests that picked the version hold it; it is freed with the last.
  const absl::Time give_up = absl::Now() + options_.unload_wait;
  absl::Duration pause = absl::Microseconds(100);
  while (!watched.expired()) {
    if (absl::Now() >= give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "model '", model, "' version ", version, " still answers ",
          watched.use_count(),
          " request(s); it is refused to new ones and freed when they finish"));
    }
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(10));
  }
  // The placed weights may still be referenced by a batch finishing its
  // scatter; the bytes are released with them.
  return absl::OkStatus();
}

detlogp::v1::ModelVersionStatus ModelManager::StatusOf(
    const ServedVersion& version,
    detlogp::v1::ModelVersionStatus::State state) const {
  detlogp::v1::ModelVersionStatus status;
  status.set_version(version.version);
  status.set_state(state);
  if (version.ready_since != absl::InfinitePast()) {
    status.set_ready_unix_micros(absl::ToUnixMicros(version.ready_since));
  }
  status.set_weights_sha256(version.weights_sha256);
  status.set_determinism_key(version.determinism_key);
  status.set_hidden_size(version.hidden_size);
  status.set_vocab_size(version.vocab_size);
  status.set_padded_vocab_size(version.padded_vocab_size);
  status.set_has_bias(version.has_bias);
  status.set_memory_bytes(version.memory_bytes);
  status.set_source(version.source);
  status.set_persisted(version.persisted);
  return status;
}

detlogp::v1::ModelInfo ModelManager::DescribeLocked(
    const std::string& name, const Model& model,
    const ServedVersion& at) const {
  detlogp::v1::ModelInfo info;
  info.set_model(name);
  info.set_model_version(at.version);
  info.set_hidden_size(at.hidden_size);
  info.set_vocab_size(at.vocab_size);
  info.set_padded_vocab_size(at.padded_vocab_size);
  info.set_weight_dtype(detlogp::v1::DTYPE_BFLOAT16);
  info.set_has_bias(at.has_bias);
  info.set_weights_sha256(at.weights_sha256);
  info.set_backend(options_.backend_description);
  *info.mutable_batching() = options_.batching;
  info.set_kernel_version(options_.key_inputs.kernel_version);
  info.set_split_policy(options_.key_inputs.split_policy);
  info.set_determinism_key(at.determinism_key);
  for (const auto& [number, version] : model.ready) {
    auto* status = info.add_versions();
    *status = StatusOf(*version, detlogp::v1::ModelVersionStatus::READY);
    // The manager's own reference is not a request.
    status->set_requests_in_flight(version.use_count() - 1);
  }
  for (const auto& [number, staged] : model.staged) {
    *info.add_versions() =
        StatusOf(*staged.version, detlogp::v1::ModelVersionStatus::STAGED);
  }
  for (const Unloading& u : unloading_) {
    auto handle = u.handle.lock();
    if (u.model != name || handle == nullptr) continue;
    auto* status = info.add_versions();
    *status = StatusOf(*handle, detlogp::v1::ModelVersionStatus::UNLOADING);
    status->set_requests_in_flight(handle.use_count() - 1);  // minus `handle`
  }
  std::sort(
      info.mutable_versions()->begin(), info.mutable_versions()->end(),
      [](const auto& a, const auto& b) { return a.version() < b.version(); });
  return info;
}

absl::StatusOr<detlogp::v1::ModelInfo> ModelManager::Describe(
    absl::string_view model, int64_t version) const {
  auto handle = Resolve(model, version);
  if (!handle.ok()) return handle.status();
  absl::ReaderMutexLock lock(&mu_);
  auto it = models_.find((*handle)->model);
  if (it == models_.end()) {
    return v1::FieldError(absl::StatusCode::kNotFound, "model",
                          absl::StrCat("'", (*handle)->model, "' was unloaded"),
                          v1::kReasonModelNotFound);
  }
  return DescribeLocked((*handle)->model, it->second, **handle);
}

std::vector<detlogp::v1::ModelInfo> ModelManager::DescribeAll() const {
  std::vector<detlogp::v1::ModelInfo> out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, model] : models_) {
    if (model.ready.empty()) continue;
    out.push_back(DescribeLocked(name, model, *model.ready.rbegin()->second));
  }
  return out;
}

int64_t ModelManager::NextVersion(const std::string& model) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = models_.find(model);
  return it == models_.end() ? 1 : it->second.next_version;
}

void ModelManager::NumberAbove(const std::string& model, int64_t version) {
  absl::MutexLock lock(&mu_);
  Model& m = models_[model];
  m.next_version = std::max(m.next_version, version + 1);
}

int64_t ModelManager::reserved_bytes() const { return tracker_->used(); }

}  // namespace detlogp::server
