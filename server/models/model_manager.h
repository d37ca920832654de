// ModelManager holds the server's named lm_head models and their numbered
// versions, and moves versions in and out while requests are served
// (TensorFlow Serving's AspiredVersionsManager with the availability
// preserving policy).
//
// A version is *placed* (weights on every device of the backend), warmed up
// through the batcher and checked before it becomes its model's latest; the
// oldest versions beyond `max_versions_per_model` are then unloaded. A
// request resolves (model, version) once, to a ServedVersion handle (a
// reference count) that it holds until it is answered: a version is freed
// only when the last handle goes, so every row of a request is computed on
// the version it picked, and an answer names that version and its key.
//
// Memory: every placed version counts its bytes (as the backend estimates
// them) against `max_model_memory_bytes` from the moment it is reserved (an
// upload's header) until it is freed; a reservation that would exceed the
// bound is RESOURCE_EXHAUSTED before any bytes are taken.
//
// Two-phase publish: StageVersion prepares a version as AddVersion does
// (placed, warmed up, numbered) but holds it STAGED: no request, pinned or
// not, can pick it. CommitVersion then persists it and makes it the latest
// in one step; AbortVersion drops it, and so does a sweep once
// `staged_timeout` passed without a commit. A fleet's pusher stages on every
// replica, then commits on all of them, or aborts on all.
//
// Failure changes nothing: a load, upload, digest check or warm-up that
// fails leaves every existing version serving as before. A new version keeps
// its model's hidden size and vocabulary (FAILED_PRECONDITION otherwise,
// before anything is placed).
//
// Example:
//   auto manager = ModelManager::Create(options);
//   auto status = (*manager)->AddVersion({.model = "policy", ...}, weights);
//   auto handle = (*manager)->Resolve("policy", /*version=*/0);  // latest
//   ... (*handle)->placed is what the batcher runs on
#ifndef DETLOGP_SERVER_MODELS_MODEL_MANAGER_H_
#define DETLOGP_SERVER_MODELS_MODEL_MANAGER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "detlogp/v1/detlogp.pb.h"
#include "server/backends/backend.h"
#include "digests/determinism_key.h"
#include "server/models/lm_head_weights.h"
#include "server/models/model_store.h"

namespace detlogp::server {

// One version of one model, as requests see it. Immutable; shared by every
// request that picked it.
struct ServedVersion {
  std::string model;
  int64_t version = 0;
  std::string weights_sha256;
  std::string determinism_key;
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t padded_vocab_size = 0;
  bool has_bias = false;
  int64_t memory_bytes = 0;
  std::string source;
  bool persisted = false;
  // When it became servable here (absl::InfinitePast() while staged).
  absl::Time ready_since = absl::InfinitePast();
  // The weights on the backend's devices; what the batcher runs.
  std::shared_ptr<const LogpModel> placed;
  // The host copy, while the backend keeps one (the CPU backend does; CUDA
  // frees it once placed): the base a delta upload is rebuilt from.
  std::weak_ptr<const LmHeadWeights> host_weights;
};

// Where a new version comes from, for ModelVersionStatus.source and the
// store.
struct VersionOrigin {
  std::string description;  // "upload", "load:<path>", "startup:<path>", ...
  // Called once the version is checked and warmed up, with its number,
  // before it becomes the latest: makes it durable (or does nothing).
  // A failure drops the version.
  std::function<absl::Status(int64_t version)> persist;
  // Already under --model_root (a restored version): reported as persisted.
  bool on_disk = false;
  // 0: the model's next number; else this one (restoring from disk, or a
  // number the client chose), which must be above every number so far.
  int64_t version = 0;
};

class ModelManager {
 public:
  struct Options {
    // The model an empty request.model means.
    std::string default_model = "default";
    // Ready versions kept per model; adding one more unloads the oldest.
    int max_versions_per_model = 2;
    // Bound on the bytes of all placed and reserved versions; 0: none.
    int64_t max_model_memory_bytes = 0;
    // Where durable versions live; may be null. Outlives the manager.
    ModelStore* store = nullptr;
    // Everything of the key but the weights (backend, ISA, kernel, policy).
    digests::DeterminismInputs key_inputs;
    // For ModelInfo: the backend and its devices, and the batching in effect.
    std::string backend_description;
    detlogp::v1::BatchingSettings batching;
    // Places weights on the backend's devices.
    std::function<absl::StatusOr<std::shared_ptr<const LogpModel>>(
        std::shared_ptr<const LmHeadWeights>)>
        place;
    // Bytes a placed version of this shape holds.
    std::function<int64_t(int64_t hidden_size, int64_t padded_vocab_size,
                          bool has_bias)>
        estimate_bytes;
    // Runs a few rows on a placed version through the batcher; OK when they
    // came back finite.
    std::function<absl::Status(const ServedVersion&)> warm_up;
    // How long UnloadModel waits for requests on the version; the version
    // stays unloading (and is freed later) when they take longer.
    absl::Duration unload_wait = absl::Minutes(5);
    // A staged version not committed within this is dropped (its memory
    // and temporary files freed).
    absl::Duration staged_timeout = absl::Seconds(60);
    // How often staged versions are checked against staged_timeout.
    absl::Duration staged_sweep_interval = absl::Milliseconds(100);
    // The clock staged versions are timed with (tests inject their own).
    std::function<absl::Time()> now = [] { return absl::Now(); };
  };

  class Tracker;  // counts bytes until placed weights are freed

  // Memory set aside for a version that is still arriving. Released when
  // destroyed unless handed to AddVersion.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept { *this = std::move(other); }
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation();
    int64_t bytes() const { return bytes_; }

   private:
    friend class ModelManager;
    std::shared_ptr<Tracker> tracker_;
    int64_t bytes_ = 0;
  };

  static absl::StatusOr<std::unique_ptr<ModelManager>> Create(Options options);
  ~ModelManager();
  ModelManager(const ModelManager&) = delete;
  ModelManager& operator=(const ModelManager&) = delete;

  const std::string& default_model() const { return options_.default_model; }

  // The version a request runs on: `model` empty means the default model,
  // `version` 0 the latest ready one. NOT_FOUND naming the model or version.
  absl::StatusOr<std::shared_ptr<const ServedVersion>> Resolve(
      absl::string_view model, int64_t version) const;

  // Sets memory aside for a version of this shape, or RESOURCE_EXHAUSTED.
  absl::StatusOr<Reservation> Reserve(int64_t hidden_size,
                                      int64_t padded_vocab_size, bool has_bias);

  // Places, warms up, persists and publishes `weights` as a version of
  // `model`; returns it once it is the model's latest. `reservation` (may be
  // empty) becomes the version's memory; without one, memory is reserved
  // here.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> AddVersion(
      const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
      VersionOrigin origin, Reservation reservation);
  absl::StatusOr<detlogp::v1::ModelVersionStatus> AddVersion(
      const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
      VersionOrigin origin);

  // As AddVersion, but holds the version STAGED (origin.version names its
  // number, > 0): not servable until CommitVersion. origin.persist runs at
  // the commit.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> StageVersion(
      const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
      VersionOrigin origin, Reservation reservation);
  // Persists a staged version and makes it the model's latest. When
  // `weights_sha256` is not empty the version's digest must equal it. A
  // version already ready with that digest is answered again (a repeated
  // commit); NOT_FOUND (reason VERSION_UNAVAILABLE) when it is neither.
  absl::StatusOr<detlogp::v1::ModelVersionStatus> CommitVersion(
      const std::string& model, int64_t version,
      const std::string& weights_sha256);
  // Drops a staged version. OK when it is not staged (never was, timed
  // out, aborted); FAILED_PRECONDITION when it was committed.
  absl::Status AbortVersion(const std::string& model, int64_t version);
  // Drops the staged versions older than staged_timeout (the sweep thread
  // calls it; tests may too). Returns how many were dropped.
  int DropExpiredStaged(absl::Time now);

  // Refuses the version to new requests, removes it from the store, and
  // waits (up to unload_wait) until every request holding it is answered.
  absl::Status Unload(const std::string& model, int64_t version);

  // A model's description at one version (0: latest), with every version.
  absl::StatusOr<detlogp::v1::ModelInfo> Describe(absl::string_view model,
                                                  int64_t version) const;
  std::vector<detlogp::v1::ModelInfo> DescribeAll() const;

  // The next number AddVersion would give `model` (tests, restore).
  int64_t NextVersion(const std::string& model) const;
  // Numbers the model's next versions above `version` (a restart: numbers
  // already used on disk are never given again).
  void NumberAbove(const std::string& model, int64_t version);
  // OK when `version` (0: the next) may be published for `model`: explicit
  // numbers must be above every number the model has had.
  absl::Status CheckVersionNumber(const std::string& model,
                                  int64_t version) const;
  int64_t reserved_bytes() const;
  // OK unless `model` has a ready version of another hidden size or
  // vocabulary: FAILED_PRECONDITION naming the field and both values. Its
  // callers' rows and targets are sized for the model's shape, so a model
  // changes shape only by unloading every version and loading the new one.
  absl::Status CheckShape(const std::string& model, int64_t hidden_size,
                          int64_t vocab_size) const;

  // ---- Implementation details; API users need not read further. ----
 private:
  // A staged version: prepared, not servable; persisted at its commit.
  struct Staged {
    std::shared_ptr<const ServedVersion> version;
    std::function<absl::Status(int64_t version)> persist;
    bool on_disk = false;
    absl::Time staged_at;
  };
  struct Model {
    // Ready versions, ascending; the last is the latest.
    std::map<int64_t, std::shared_ptr<const ServedVersion>> ready;
    std::map<int64_t, Staged> staged;
    int64_t next_version = 1;
  };
  // A version out of routing but still held by requests.
  struct Unloading {
    std::string model;
    int64_t version;
    std::weak_ptr<const ServedVersion> handle;
  };
  explicit ModelManager(Options options);
  // Validates, places, warms up and numbers a version (not yet routed).
  absl::StatusOr<std::shared_ptr<ServedVersion>> Prepare(
      const std::string& model, std::shared_ptr<const LmHeadWeights> weights,
      const VersionOrigin& origin, Reservation reservation);
  // Makes a prepared (and persisted) version its model's latest.
  detlogp::v1::ModelVersionStatus Publish(
      std::shared_ptr<ServedVersion> version);
  // After a staged version is dropped: its number is given again.
  void GiveBackNumberLocked(Model& model, int64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLoop();
  bool Stopping() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; }
  static absl::Status VersionTaken(const std::string& model, int64_t asked,
                                   int64_t next);
  absl::Status CheckShapeLocked(const std::string& model, int64_t hidden_size,
                                int64_t vocab_size) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  detlogp::v1::ModelVersionStatus StatusOf(
      const ServedVersion& version,
      detlogp::v1::ModelVersionStatus::State state) const;
  detlogp::v1::ModelInfo DescribeLocked(const std::string& name,
                                        const Model& model,
                                        const ServedVersion& at) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Moves a version out of routing (its files go with RemoveFiles).
  void RetireLocked(const std::string& name, Model& model, int64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Outside mu_: unlinking a 1.2 GB file took 0.3-0.4 s on the H200 host,
  // and every request resolves its version under mu_.
  void RemoveFiles(const std::string& name,
                   const std::vector<int64_t>& versions);

  const Options options_;
  std::shared_ptr<Tracker> tracker_;
  mutable absl::Mutex mu_;
  std::map<std::string, Model> models_ ABSL_GUARDED_BY(mu_);
  std::vector<Unloading> unloading_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Declared last: joined (in the destructor) before the rest goes.
  std::thread sweeper_;
};

}  // namespace detlogp::server

#endif  // DETLOGP_SERVER_MODELS_MODEL_MANAGER_H_
