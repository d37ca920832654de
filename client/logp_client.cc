#include "client/logp_client.h"

#include <grpc/slice.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/sync_stream.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "client/grpc_lifetime.h"
#include "client/request_rows.h"
#include "proto/dtype_bytes.h"
#include "proto/wire_format.h"
#include "proto/status_details.h"
#include "spdlog/spdlog.h"

namespace detlogp::client {

detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, std::string data, const std::vector<int64_t>& targets,
    const LogProbOptions& options) {
  detlogp::v1::LogProbRequest request;
  request.set_request_id(std::move(request_id));
  detlogp::v1::Tensor* hidden = request.mutable_hidden();
  hidden->set_dtype(dtype);
  hidden->add_shape(rows);
  hidden->add_shape(hidden_size);
  hidden->set_data(std::move(data));
  request.mutable_target_ids()->Add(targets.begin(), targets.end());
  request.set_temperature(options.temperature);
  request.set_return_lse(options.return_lse);
  request.set_return_entropy(options.return_entropy);
  request.set_top_k(options.top_k);
  request.set_model(options.model);
  request.set_model_version(options.model_version);
  request.set_return_timing(options.return_timing);
  return request;
}

detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, const RegionRef& region,
    const std::vector<int64_t>& targets, const LogProbOptions& options) {
  detlogp::v1::LogProbRequest request = MakeLogProbRequest(
      std::move(request_id), dtype, rows, hidden_size, "", targets, options);
  detlogp::v1::SharedMemoryRef* ref =
      request.mutable_hidden()->mutable_shared_memory();
  ref->set_region(region.region);
  ref->set_offset(region.offset);
  // A shape or dtype the server refuses gets its own message; a byte_size
  // that does not match them is named by the server too.
  ref->set_byte_size(region.byte_size != 0
                         ? region.byte_size
                         : rows * hidden_size * detlogp::v1::DTypeBytes(dtype));
  return request;
}

detlogp::v1::LogProbRequest MakeLogProbRequest(
    std::string request_id, detlogp::v1::DType dtype, int64_t rows,
    int64_t hidden_size, std::string data, const std::vector<int64_t>& targets,
    float temperature, bool return_lse, std::string model,
    int64_t model_version) {
  LogProbOptions options;
  options.temperature = temperature;
  options.return_lse = return_lse;
  options.model = std::move(model);
  options.model_version = model_version;
  return MakeLogProbRequest(std::move(request_id), dtype, rows, hidden_size,
                            std::move(data), targets, options);
}

namespace {

// MakeChannel's channel; `idle_timeout` > 0 closes its connection after that
// long unused; `tls_name`: the name the server's certificate must carry
// (empty: the target's).
std::shared_ptr<grpc::Channel> MakeChannelIdleAfter(
    const LogpClient::Options& options, absl::Duration idle_timeout,
    const std::string& tls_name = "") {
  KeepGrpcInitialized();
  grpc::ChannelArguments args;
  if (idle_timeout > absl::ZeroDuration()) {
    args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS,
                static_cast<int>(std::min<int64_t>(
                    absl::ToInt64Milliseconds(idle_timeout), 1 << 30)));
  }
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (options.own_connection)
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::string policy = options.load_balancing_policy;
  // An address a "dns:" name resolved to is checked against the name's
  // certificate.
  if (!options.tls_root_certs.empty() && !tls_name.empty()) {
    args.SetSslTargetNameOverride(tls_name);
  }
  // A dns: target names every replica behind a headless Service; gRPC's
  // pick_first would send every call to the first.
  if (policy.empty() && absl::StartsWith(options.target, "dns:")) {
    policy = "round_robin";
  }
  if (!policy.empty()) args.SetLoadBalancingPolicyName(policy);
  for (const auto& [key, value] : options.int_channel_args) {
    args.SetInt(key, value);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!options.tls_root_certs.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs;
    ssl.pem_cert_chain = options.tls_client_cert;
    ssl.pem_private_key = options.tls_client_key;
    credentials = grpc::SslCredentials(ssl);
  }
  return grpc::CreateCustomChannel(options.target, credentials, args);
}

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const LogpClient::Options& options,
                                           const std::string& tls_name) {
  return MakeChannelIdleAfter(options, absl::ZeroDuration(), tls_name);
}

LogpClient::LogpClient(const Options& options)
    : options_(options),
      system_regions_(options.system_shared_memory_regions) {}

LogpClient::Replica::Replica(uint64_t id_in, std::string target_in,
                             std::string tls_name_in,
                             std::shared_ptr<grpc::Channel> channel_in,
                             int64_t assumed_queue_rows,
                             const ReplicaHealth::Options& health_options,
                             std::function<void(grpc::ClientContext*)> prepare)
    : id(id_in),
      target(std::move(target_in)),
      tls_name(std::move(tls_name_in)),
      channel(std::move(channel_in)),
      stub(detlogp::v1::LogProbService::NewStub(channel)),
      regions(channel, std::move(prepare)),
      window(assumed_queue_rows),
      health(health_options) {}

absl::Time LogpClient::Now() const {
  return options_.clock ? options_.clock() : absl::Now();
}

std::shared_ptr<LogpClient::Replica> LogpClient::NewReplica(
    const std::string& target, const std::string& tls_name) {
  Options one = options_;
  one.target = target;
  ReplicaHealth::Options health;
  health.first_backoff = options_.replica_first_backoff;
  health.max_backoff = options_.replica_max_backoff;
  return std::make_shared<Replica>(
      next_replica_id_++, target, tls_name,
      MakeChannelIdleAfter(one, absl::ZeroDuration(), tls_name),
      options_.assumed_queue_rows, health,
      [this](grpc::ClientContext* context) { PrepareContext(context); });
}

absl::Status LogpClient::RefreshReplicas() {
  absl::MutexLock resolving(&resolve_mu_);
  std::vector<std::pair<size_t, DnsName>> names;
  {
    absl::MutexLock lock(&replicas_mu_);
    for (size_t e = 0; e < entries_.size(); ++e) {
      if (entries_[e].dns.has_value()) names.emplace_back(e, *entries_[e].dns);
    }
    next_resolve_ = Now() + options_.dns_refresh_interval;
  }
  if (names.empty()) return absl::OkStatus();
  const TargetResolver& resolve =
      options_.resolver ? options_.resolver : ResolveWithGetaddrinfo;
  // Resolved outside the lock: calls go on with the replicas they find.
  std::vector<absl::StatusOr<std::vector<std::string>>> found;
  for (const auto& [entry, name] : names) {
    found.push_back(resolve(name.host, name.port));
  }
  absl::Status first_failure;
  absl::MutexLock lock(&replicas_mu_);
  for (size_t n = 0; n < names.size(); ++n) {
    TargetEntry& entry = entries_[names[n].first];
    if (!found[n].ok() || found[n]->empty()) {
      const absl::Status why = found[n].ok()
                                   ? absl::UnavailableError("no address")
                                   : found[n].status();
      spdlog::warn("{}: resolving failed; its {} replicas stay: {}",
                   entry.target, entry.replicas.size(), why.ToString());
      if (first_failure.ok()) {
        first_failure = absl::Status(
            why.code(), absl::StrCat(entry.target, ": ", why.message()));
      }
      continue;
    }
    ReplicaList kept;
    for (const std::string& address : *found[n]) {
      auto same = std::find_if(entry.replicas.begin(), entry.replicas.end(),
                               [&](const std::shared_ptr<Replica>& r) {
                                 return r->target == address;
                               });
      kept.push_back(same != entry.replicas.end()
                         ? *same
                         : NewReplica(address, entry.dns->host));
    }
    for (const std::shared_ptr<Replica>& old : entry.replicas) {
      if (std::find(kept.begin(), kept.end(), old) == kept.end()) {
        // Drains: calls under way send it nothing new, and it is freed when
        // the last of them ends.
        old->retired = true;
      }
    }
    entry.replicas = std::move(kept);
  }
  replicas_.clear();
  for (const TargetEntry& entry : entries_) {
    replicas_.insert(replicas_.end(), entry.replicas.begin(),
                     entry.replicas.end());
  }
  return first_failure;
}

LogpClient::ReplicaList LogpClient::Replicas() {
  bool due;
  {
    absl::MutexLock lock(&replicas_mu_);
    due = Now() >= next_resolve_;
    if (!due) return replicas_;
  }
  // One caller resolves; the others go on with the replicas they find.
  if (resolve_mu_.TryLock()) {
    resolve_mu_.Unlock();
    RefreshReplicas().IgnoreError();
  }
  absl::MutexLock lock(&replicas_mu_);
  return replicas_;
}

std::vector<std::string> LogpClient::replica_targets() {
  std::vector<std::string> targets;
  for (const std::shared_ptr<Replica>& replica : Replicas()) {
    targets.push_back(replica->target);
  }
  return targets;
}

absl::StatusOr<std::unique_ptr<LogpClient>> LogpClient::Create(
    const Options& options) {
  if (absl::Status usable = CheckGrpcUsableInThisProcess(); !usable.ok()) {
    return usable;
  }
  if (options.targets.empty() && options.target.empty()) {
    return absl::InvalidArgumentError("target: empty");
  }
  for (size_t i = 0; i < options.targets.size(); ++i) {
    if (options.targets[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("targets[", i, "]: empty"));
    }
  }
  if (options.replica_first_backoff <= absl::ZeroDuration() ||
      options.replica_max_backoff < options.replica_first_backoff) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica_first_backoff, replica_max_backoff: ",
                     absl::FormatDuration(options.replica_first_backoff), ", ",
                     absl::FormatDuration(options.replica_max_backoff),
                     " (positive, the first no longer than the most)"));
  }
  if (options.assumed_queue_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("assumed_queue_rows: ", options.assumed_queue_rows,
                     " is not positive"));
  }
  if (options.cuda_shared_memory_regions < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_shared_memory_regions: ", options.cuda_shared_memory_regions,
        " is not positive"));
  }
  if (options.connections < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections: ", options.connections, " is negative"));
  }
  if (options.spread_request_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("spread_request_bytes: ", options.spread_request_bytes,
                     " is not positive"));
  }
  if (options.system_shared_memory_regions < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "system_shared_memory_regions: ", options.system_shared_memory_regions,
        " is not positive"));
  }
  if (options.region_piece_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("region_piece_bytes: ", options.region_piece_bytes,
                     " is not positive"));
  }
  if (options.spread_requests_in_flight < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spread_requests_in_flight: ", options.spread_requests_in_flight,
        " is not positive"));
  }
  if (options.send_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "send_threads: ", options.send_threads, " is not positive"));
  }
  if (options.dns_refresh_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dns_refresh_interval: ",
        absl::FormatDuration(options.dns_refresh_interval), " is negative"));
  }
  const std::vector<std::string> targets =
      options.targets.empty() ? std::vector<std::string>{options.target}
                              : options.targets;
  std::vector<TargetEntry> entries;
  for (size_t i = 0; i < targets.size(); ++i) {
    auto dns = ParseDnsTarget(targets[i]);
    if (!dns.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          options.targets.empty() ? "target" : absl::StrCat("targets[", i, "]"),
          dns.status().message().substr(std::string("target").size())));
    }
    entries.push_back(TargetEntry{targets[i], *dns, {}});
  }
  std::unique_ptr<LogpClient> client(new LogpClient(options));
  bool any_dns = false;
  {
    absl::MutexLock lock(&client->replicas_mu_);
    for (TargetEntry& entry : entries) {
      if (entry.dns.has_value()) {
        any_dns = true;
      } else {
        entry.replicas.push_back(client->NewReplica(entry.target, ""));
        client->replicas_.push_back(entry.replicas.back());
      }
    }
    client->entries_ = std::move(entries);
    // The first target's control calls: on its replica, or on a channel to
    // the "dns:" name.
    const TargetEntry& first = client->entries_.front();
    client->control_ = first.dns.has_value()
                           ? client->NewReplica(first.target, "")
                           : first.replicas.front();
  }
  if (any_dns) {
    // A name that does not resolve yet (pods not ready) is asked again by
    // the first call.
    if (absl::Status s = client->RefreshReplicas(); !s.ok()) {
      absl::MutexLock lock(&client->replicas_mu_);
      client->next_resolve_ = absl::InfinitePast();
    }
  }
  client->channel_ = client->control_->channel;
  client->stub_ = detlogp::v1::LogProbService::NewStub(client->channel_);
  client->projection_stub_ =
      detlogp::v1::ProjectionService::NewStub(client->channel_);
  client->senders_ = std::make_unique<TaskPool>(options.send_threads);
  client->regions_api_ = std::make_unique<RegionApi>(
      client->channel_, [raw = client.get()](grpc::ClientContext* context) {
        raw->PrepareContext(context);
      });
  client->projection_ =
      std::make_unique<ProjectionConnection>(client->channel_);
  return client;
}

void LogpClient::PrepareContext(grpc::ClientContext* context,
                                absl::Time deadline) const {
  context->set_deadline(
      absl::ToChronoTime(std::min(deadline, absl::Now() + options_.timeout)));
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
}

absl::StatusOr<detlogp::v1::ModelInfo> LogpClient::GetModelInfo(
    const std::string& model, int64_t model_version) {
  if (absl::Status usable = CheckGrpcUsableInThisProcess(); !usable.ok()) {
    return usable;
  }
  grpc::ClientContext context;
  PrepareContext(&context);
  detlogp::v1::GetModelInfoRequest request;
  request.set_model(model);
  request.set_model_version(model_version);
  detlogp::v1::ModelInfo info;
  grpc::Status status = stub_->GetModelInfo(&context, request, &info);
  if (!status.ok()) return FromGrpcStatus(status);
  // The server's limits and the first replica's queue are now known: calls
  // need not ask for them.
  {
    absl::MutexLock limits_lock(&limits_mu_);
    if (!limits_.has_value()) limits_ = info;
  }
  Replica& first = *control_;
  absl::MutexLock lock(&first.mu);
  if (!first.info.has_value()) {
    first.window.SetCapacity(info.max_queue_rows());
    first.info = info;
  }
  return info;
}

LogpClient::~LogpClient() {
  ReleaseIdleSystemRegions();
  absl::MutexLock lock(&cuda_mu_);
  for (auto& [device, pool] : cuda_pools_) {
    for (const auto& region : pool->TakeIdle()) ReleaseCudaRegion(*region);
  }
  cuda_pools_.clear();  // frees the device memory while the runtime is here
}

std::string LogpClient::shared_memory_refusal() const {
  std::vector<std::string> refusals;
  {
    absl::MutexLock lock(&shared_memory_mu_);
    if (!shared_memory_refusal_.empty()) {
      refusals.push_back(absl::StrCat("system: ", shared_memory_refusal_));
    }
  }
  absl::MutexLock lock(&cuda_mu_);
  if (!cuda_refusal_.empty()) {
    refusals.push_back(absl::StrCat("cuda: ", cuda_refusal_));
  }
  return absl::StrJoin(refusals, "; ");
}

namespace {

// Room for a row's target id (a varint) and the message's other fields.
constexpr int64_t kTargetBytes = 11;
constexpr int64_t kMessageOverheadBytes = 64 << 10;

// Calls with this many bytes of rows in their messages are spread over
// kAutoConnections connections by default, in requests of at least
// kMinSpreadRequestBytes: one connection moves a large message at a fraction
// of what several do side by side (docs/performance.md, "One caller's large
// batch").
constexpr int kAutoConnections = 8;
constexpr int64_t kAutoConnectionsMinBytes = int64_t{8} << 20;
constexpr int64_t kMinSpreadRequestBytes = int64_t{1} << 20;

// A call through a system region of the client's is written into it piece
// by piece as its requests go: at most kRegionPieces pieces of at least
// Options::region_piece_bytes (docs/performance.md, "One caller's large
// batch").
constexpr int64_t kRegionPieces = 8;

}  // namespace

detlogp::v1::LogProbRequest SliceLogProbRequest(
    const detlogp::v1::LogProbRequest& request, int64_t begin, int64_t count) {
  detlogp::v1::LogProbRequest slice = WithoutRows(request);
  const detlogp::v1::Tensor& hidden = request.hidden();
  detlogp::v1::Tensor* out = slice.mutable_hidden();
  out->add_shape(count);
  out->add_shape(hidden.shape(1));
  const int64_t row_bytes = RowBytes(request);
  if (hidden.has_shared_memory()) {
    detlogp::v1::SharedMemoryRef* ref = out->mutable_shared_memory();
    ref->set_region(hidden.shared_memory().region());
    ref->set_offset(hidden.shared_memory().offset() + begin * row_bytes);
    ref->set_byte_size(count * row_bytes);
  } else {
    out->set_data(hidden.data().substr(begin * row_bytes, count * row_bytes));
  }
  slice.mutable_target_ids()->Add(request.target_ids().begin() + begin,
                                  request.target_ids().begin() + begin + count);
  return slice;
}

absl::StatusOr<int64_t> LogpClient::RowsPerRequest(
    const detlogp::v1::LogProbRequest& request, bool by_reference, bool spread,
    const ReplicaList& replicas) {
  const int64_t rows = request.target_ids_size();
  const int64_t row_bytes = RowBytes(request);
  if (!options_.split_large_calls || row_bytes == 0) return 0;
  const int64_t wire_row_bytes = kTargetBytes + (by_reference ? 0 : row_bytes);
  int64_t max_rows = options_.max_request_rows;
  int64_t max_message_bytes = options_.max_message_bytes;
  if (max_rows <= 0) {
    // A server may take fewer rows than its defaults (--max_request_rows):
    // its limits are asked once, for the first call of more than one row.
    if (!spread && rows <= 1) return 0;
    absl::MutexLock lock(&limits_mu_);
    if (!limits_.has_value()) {
      // The first replica that answers (their limits are alike).
      for (const std::shared_ptr<Replica>& replica : replicas) {
        if (!replica->health.Usable(absl::Now())) continue;
        grpc::ClientContext context;
        PrepareContext(&context);
        detlogp::v1::GetModelInfoRequest ask;
        ask.set_model(request.model());
        ask.set_model_version(request.model_version());
        detlogp::v1::ModelInfo info;
        if (!replica->stub->GetModelInfo(&context, ask, &info).ok()) continue;
        replica->window.SetCapacity(info.max_queue_rows());
        {
          absl::MutexLock replica_lock(&replica->mu);
          replica->info = info;
        }
        limits_ = std::move(info);
        break;
      }
      // The server names what is wrong (an unknown model) when the call
      // goes as it is.
      if (!limits_.has_value()) return 0;
    }
    max_rows = limits_->max_request_rows();
    if (limits_->max_receive_message_bytes() > 0) {
      max_message_bytes = std::min<int64_t>(
          max_message_bytes, limits_->max_receive_message_bytes());
    }
  }
  const int64_t rows_by_bytes =
      (max_message_bytes - kMessageOverheadBytes) / wire_row_bytes;
  if (max_rows <= 0) max_rows = rows_by_bytes;  // a server that does not say
  return std::max<int64_t>(1, std::min(max_rows, rows_by_bytes));
}

absl::StatusOr<ScoreResult> LogpClient::Score(
    const detlogp::v1::LogProbRequest& request, absl::Time deadline) {
  if (absl::Status usable = CheckGrpcUsableInThisProcess(); !usable.ok()) {
    return usable;
  }
  deadline = std::min(deadline, absl::Now() + options_.timeout);
  if (options_.system_shared_memory) {
    auto through_region =
        ScoreThroughSystemRegion(request, request.hidden().data(), deadline);
    if (!through_region.ok()) return through_region.status();
    if (through_region->has_value()) return **std::move(through_region);
  }
  absl::StatusOr<ScoreResult> result = ScoreCut(
      request, request.hidden().data(), /*rows_beside=*/false, deadline);
  if (result.ok() && request.hidden().has_shared_memory()) {
    result->path = "named_region";
    result->used_shared_memory = true;
  }
  if (result.ok() && options_.system_shared_memory &&
      !request.hidden().has_shared_memory() &&
      !request.hidden().data().empty()) {
    absl::MutexLock lock(&shared_memory_mu_);
    if (!shared_memory_refusal_.empty()) result->path_refused = "system_shm";
  }
  return result;
}

absl::StatusOr<ScoreResult> LogpClient::Score(
    const detlogp::v1::LogProbRequest& header, absl::string_view rows,
    absl::Time deadline) {
  if (absl::Status usable = CheckGrpcUsableInThisProcess(); !usable.ok()) {
    return usable;
  }
  if (!header.hidden().data().empty() || header.hidden().has_shared_memory()) {
    return absl::InvalidArgumentError(
        "hidden: the rows are given beside the request, which must carry "
        "neither data nor shared_memory");
  }
  const int64_t expected =
      static_cast<int64_t>(header.target_ids_size()) * RowBytes(header);
  if (RowBytes(header) <= 0 || static_cast<int64_t>(rows.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden.data: ", rows.size(), " bytes of rows for ",
                     header.target_ids_size(), " targets of ", RowBytes(header),
                     " bytes each (hidden.shape and dtype)"));
  }
  deadline = std::min(deadline, absl::Now() + options_.timeout);
  if (options_.system_shared_memory) {
    auto through_region = ScoreThroughSystemRegion(header, rows, deadline);
    if (!through_region.ok()) return through_region.status();
    if (through_region->has_value()) return **std::move(through_region);
  }
  absl::StatusOr<ScoreResult> result =
      ScoreCut(header, rows, /*rows_beside=*/true, deadline);
  if (result.ok() && options_.system_shared_memory && !rows.empty()) {
    absl::MutexLock lock(&shared_memory_mu_);
    if (!shared_memory_refusal_.empty()) result->path_refused = "system_shm";
  }
  return result;
}

absl::StatusOr<ScoreResult> LogpClient::ScoreCut(
    const detlogp::v1::LogProbRequest& request, absl::string_view rows_bytes,
    bool rows_beside, absl::Time deadline, const ReplicaList* only,
    const RegionWrite* region_write) {
  // A region the caller named is registered where its control calls go.
  const ReplicaList replica_list = only != nullptr ? *only
                                   : request.hidden().has_shared_memory()
                                       ? ReplicaList{control_}
                                       : Replicas();
  if (replica_list.empty()) {
    absl::MutexLock lock(&replicas_mu_);
    next_resolve_ = absl::InfinitePast();  // asked again by the next call
    return absl::UnavailableError(
        absl::StrCat("targets: no replica to send to (",
                     entries_.empty() ? std::string() : entries_.front().target,
                     " resolved to no address yet)"));
  }
  const bool shared = request.hidden().has_shared_memory();
  const int64_t rows = request.target_ids_size();
  const int64_t row_bytes = RowBytes(request);
  const int64_t bytes = rows * row_bytes;
  int connections = options_.connections;
  if (connections <= 0) {
    connections = bytes >= kAutoConnectionsMinBytes ? kAutoConnections : 1;
  }
  // Rows that do not fill the shape go as they are: the server names the
  // field.
  const bool fills_shape =
      row_bytes > 0 && static_cast<int64_t>(rows_bytes.size()) == bytes;
  if (shared || !options_.split_large_calls || !fills_shape) connections = 1;
  const bool spread = connections > 1 && rows > 1;
  auto rows_per_request = RowsPerRequest(request, shared, spread, replica_list);
  if (!rows_per_request.ok()) return rows_per_request.status();
  int64_t rows_each = *rows_per_request > 0 ? *rows_per_request : rows;
  if (spread) {
    // Every connection gets a share (cut no smaller than
    // kMinSpreadRequestBytes for that), in requests of at most
    // spread_request_bytes.
    const int64_t share =
        std::min(std::max((rows + connections - 1) / connections,
                          kMinSpreadRequestBytes / row_bytes),
                 options_.spread_request_bytes / row_bytes);
    rows_each = std::min(rows_each, share);
  }
  const bool writes_region =
      shared && region_write != nullptr && row_bytes > 0 &&
      static_cast<int64_t>(region_write->rows.size()) == rows * row_bytes;
  if (writes_region) {
    // Pieces small enough that the server starts on the first while the
    // rest are written, large enough to batch well; one connection per
    // requests_in_flight pieces puts them all in flight.
    const int64_t piece = std::max((rows + kRegionPieces - 1) / kRegionPieces,
                                   options_.region_piece_bytes / row_bytes);
    rows_each = std::min(rows_each, std::max<int64_t>(piece, 1));
    const int64_t pieces = (rows + rows_each - 1) / rows_each;
    const int in_flight = std::max(options_.spread_requests_in_flight, 1);
    connections = static_cast<int>((pieces + in_flight - 1) / in_flight);
  }
  rows_each = std::max<int64_t>(rows_each, 1);
  std::vector<CallPart> parts;
  if (fills_shape && !shared && rows > 0) {
    // Each request's rows are written once, straight from the caller's
    // bytes into gRPC's buffer, when it is sent.
    RowSlices slices = CutRows(request, rows_each, rows_bytes);
    for (size_t i = 0; i < slices.headers.size(); ++i) {
      parts.push_back({std::move(slices.headers[i]), slices.rows[i],
                       static_cast<int64_t>(i) * rows_each});
    }
  } else if (rows > rows_each && (shared || fills_shape)) {
    for (int64_t begin = 0; begin < rows; begin += rows_each) {
      parts.push_back({SliceLogProbRequest(request, begin,
                                           std::min(rows_each, rows - begin)),
                       {},
                       begin});
    }
  } else {
    parts.push_back({request, {}});
    if (rows_beside) parts.back().rows = rows_bytes;
  }
  if (writes_region) {
    for (CallPart& part : parts) {
      const int64_t offset = part.first_row * row_bytes;
      const int64_t size = part.header.target_ids_size() * row_bytes;
      part.region_rows = region_write->region + offset;
      part.region_source = region_write->rows.substr(offset, size);
    }
  }
  const int used = static_cast<int>(
      std::min<size_t>(std::max(connections, 1), parts.size()));
  // Every replica of the list takes requests, each on its own connection
  // and kept ones beside it, the call's connections shared out.
  const size_t replicas = replica_list.size();
  const int per_replica = std::max<int>(
      1, (used + static_cast<int>(replicas) - 1) / static_cast<int>(replicas));
  std::vector<std::vector<std::unique_ptr<RawConnection>>> kept(replicas);
  std::vector<CallReplica> call_replicas;
  for (size_t r = 0; r < replicas; ++r) {
    Replica& replica = *replica_list[r];
    AskLimitsInBackground(replica_list[r], request.model());
    kept[r] = TakeSpreadConnections(replica, per_replica - 1);
    CallReplica call{&replica.window,
                     &replica.health,
                     {replica.channel},
                     replica.target,
                     &replica.retired};
    for (const auto& connection : kept[r]) {
      call.connections.push_back(connection->channel);
    }
    call_replicas.push_back(std::move(call));
  }
  CallEngineOptions engine;
  engine.requests_in_flight_per_connection = options_.spread_requests_in_flight;
  engine.senders = senders_.get();
  engine.prepare_context = [this](grpc::ClientContext* context,
                                  absl::Time call_deadline) {
    PrepareContext(context, call_deadline);
  };
  engine.unknown_queue_rows = options_.assumed_queue_rows;
  CallStats stats;
  absl::StatusOr<std::vector<ScoreResult>> answers =
      SendCallParts(std::move(parts), call_replicas, engine, deadline, &stats);
  int connections_used = 0;
  for (size_t r = 0; r < replicas; ++r) {
    connections_used += static_cast<int>(kept[r].size()) + 1;
    GiveBackSpreadConnections(*replica_list[r], std::move(kept[r]));
  }
  if (stats.replica_retries > 0) {
    // A replica failed: its name may have moved (a pod rescheduled).
    absl::MutexLock lock(&replicas_mu_);
    next_resolve_ = std::min(next_resolve_, Now());
  }
  if (!answers.ok()) return answers.status();
  ScoreResult joined = JoinScoreResults(*std::move(answers));
  joined.connections = connections_used;
  joined.queue_full_retries = stats.queue_full_retries;
  joined.replica_retries = stats.replica_retries;
  joined.replicas_answering = static_cast<int>(
      std::count_if(stats.answered_by.begin(), stats.answered_by.end(),
                    [](int64_t answered) { return answered > 0; }));
  return joined;
}

LogpClient::RawConnection::RawConnection(
    std::shared_ptr<grpc::Channel> channel_in)
    : channel(std::move(channel_in)) {}

namespace {

// Writes requests 0..checks.size()-1 on `stream` (`write(i)` writes the
// i-th) on one thread while this one reads, so the server can pipeline;
// answer i is checked against checks[i].
template <typename Stream, typename Write>
absl::StatusOr<std::vector<ScoreResult>> StreamAndCheck(
    Stream& stream, const std::vector<detlogp::v1::LogProbRequest>& checks,
    Write write) {
  std::thread writer([&] {
    for (size_t i = 0; i < checks.size(); ++i) {
      if (!write(i)) break;
    }
    stream.WritesDone();
  });
  std::vector<ScoreResult> results;
  absl::Status problem;
  detlogp::v1::LogProbResponse response;
  while (stream.Read(&response)) {
    if (!problem.ok()) continue;  // drain, so that Finish can return
    if (results.size() >= checks.size()) {
      problem = absl::DataLossError(absl::StrCat(
          "stream answered more than the ", checks.size(), " requests sent"));
      continue;
    }
    absl::StatusOr<ScoreResult> result =
        ToScoreResult(checks[results.size()], response);
    if (!result.ok()) {
      problem =
          absl::Status(result.status().code(),
                       absl::StrCat(result.status().message(),
                                    " [stream answer ", results.size(), "]"));
      continue;
    }
    results.push_back(*std::move(result));
  }
  writer.join();
  grpc::Status status = stream.Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!problem.ok()) return problem;
  if (results.size() != checks.size()) {
    return absl::DataLossError(absl::StrCat("stream answered ", results.size(),
                                            " of ", checks.size(),
                                            " requests"));
  }
  return results;
}

}  // namespace

absl::StatusOr<std::vector<ScoreResult>> LogpClient::ScoreStream(
    const std::vector<detlogp::v1::LogProbRequest>& requests,
    absl::Time deadline) {
  if (absl::Status usable = CheckGrpcUsableInThisProcess(); !usable.ok()) {
    return usable;
  }
  grpc::ClientContext context;
  PrepareContext(&context, deadline);
  auto stream = stub_->StreamLogProbs(&context);
  return StreamAndCheck(*stream, requests,
                        [&](size_t i) { return stream->Write(requests[i]); });
}

absl::Status LogpClient::RegisterSystemRegion(const std::string& name,
                                              const std::string& key,
                                              int64_t offset,
                                              int64_t byte_size) {
  return regions_api_->RegisterSystem(name, key, offset, byte_size);
}

absl::Status LogpClient::RegisterCudaRegion(const std::string& name,
                                            const std::string& raw_handle,
                                            int64_t device_id,
                                            int64_t byte_size) {
  return regions_api_->RegisterCuda(name, raw_handle, device_id, byte_size);
}

absl::Status LogpClient::UnregisterSystemRegion(const std::string& name) {
  return regions_api_->UnregisterSystem(name);
}

absl::Status LogpClient::UnregisterCudaRegion(const std::string& name) {
  return regions_api_->UnregisterCuda(name);
}

absl::StatusOr<detlogp::v1::SystemSharedMemoryStatusResponse>
LogpClient::SystemRegionStatus(const std::string& name) {
  return regions_api_->SystemStatus(name);
}

absl::StatusOr<detlogp::v1::CudaSharedMemoryStatusResponse>
LogpClient::CudaRegionStatus(const std::string& name) {
  return regions_api_->CudaStatus(name);
}

absl::StatusOr<const CudaRuntime*> LogpClient::Cuda() {
  absl::MutexLock lock(&cuda_runtime_mu_);
  if (!cuda_runtime_.has_value()) {
    cuda_runtime_ = CudaRuntime::Load(options_.cuda_runtime);
  }
  if (!cuda_runtime_->ok()) return cuda_runtime_->status();
  return cuda_runtime_->value().get();
}

absl::StatusOr<ScoreResult> LogpClient::Score(
    const DeviceRows& rows, const std::vector<int64_t>& targets,
    const LogProbOptions& options, std::string request_id,
    absl::Time deadline) {
  if (absl::Status usable = CheckGrpcUsableInThisProcess(); !usable.ok()) {
    return usable;
  }
  deadline = std::min(deadline, absl::Now() + options_.timeout);
  // What the server cannot check: it never sees the pointer.
  const int64_t element_bytes = detlogp::v1::DTypeBytes(rows.dtype);
  if (rows.data == nullptr) {
    return absl::InvalidArgumentError("rows.data: null");
  }
  if (element_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows.dtype: ", detlogp::v1::DType_Name(rows.dtype),
                     " is not bf16, fp16 or fp32"));
  }
  if (rows.rows <= 0 || rows.hidden_size <= 0 ||
      rows.rows > std::numeric_limits<int64_t>::max() / rows.hidden_size /
                      element_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows.rows, rows.hidden_size: [", rows.rows, ", ",
                     rows.hidden_size, "] is not a shape of rows"));
  }
  if (static_cast<int64_t>(targets.size()) != rows.rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets: ", targets.size(), " target ids for ", rows.rows, " rows"));
  }
  auto cuda = Cuda();
  if (!cuda.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rows.data: rows on a GPU cannot be read without the "
                     "CUDA runtime: ",
                     cuda.status().message()));
  }
  auto device = (*cuda)->DeviceOf(rows.data);
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        absl::StrCat("rows.data: ", device.status().message()));
  }
  if (*device != rows.device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows.device: ", rows.device, ", but the rows are on cuda:", *device));
  }
  detlogp::v1::LogProbRequest request =
      MakeLogProbRequest(std::move(request_id), rows.dtype, rows.rows,
                         rows.hidden_size, std::string(), targets, options);
  // CUDA regions hold bf16 rows: the server converts other dtypes on the
  // host path only.
  if (options_.cuda_shared_memory &&
      rows.dtype == detlogp::v1::DTYPE_BFLOAT16) {
    auto through_region =
        ScoreThroughCudaRegion(**cuda, rows, request, deadline);
    if (!through_region.ok()) return through_region.status();
    if (through_region->has_value()) return **std::move(through_region);
  }
  const int64_t bytes = rows.rows * rows.hidden_size * element_bytes;
  std::string data(static_cast<size_t>(bytes), '\0');
  if (absl::Status s =
          (*cuda)->Copy(data.data(), rows.data, bytes, CudaCopy::kDeviceToHost,
                        rows.device, rows.stream);
      !s.ok()) {
    return s;
  }
  request.mutable_hidden()->set_data(std::move(data));
  absl::StatusOr<ScoreResult> result = Score(request, deadline);
  if (result.ok() && options_.cuda_shared_memory &&
      rows.dtype == detlogp::v1::DTYPE_BFLOAT16 && !CudaRefusal().empty()) {
    result->path_refused = "cuda_shm";
  }
  return result;
}

std::vector<std::unique_ptr<LogpClient::RawConnection>>
LogpClient::TakeSpreadConnections(Replica& replica, int count) {
  std::vector<std::unique_ptr<RawConnection>> taken;
  {
    absl::MutexLock lock(&replica.mu);
    std::vector<std::unique_ptr<RawConnection>>& idle = replica.idle_spread;
    while (static_cast<int>(taken.size()) < count && !idle.empty()) {
      taken.push_back(std::move(idle.back()));
      idle.pop_back();
    }
  }
  {
    absl::MutexLock lock(&spread_mu_);
    spread_opened_ += count - static_cast<int64_t>(taken.size());
  }
  // Distinct channels on a local subchannel pool: distinct TCP connections.
  Options own = options_;
  own.target = replica.target;
  own.own_connection = true;
  while (static_cast<int>(taken.size()) < count) {
    taken.push_back(std::make_unique<RawConnection>(MakeChannelIdleAfter(
        own, options_.spread_connection_idle_timeout, replica.tls_name)));
  }
  return taken;
}

void LogpClient::GiveBackSpreadConnections(
    Replica& replica, std::vector<std::unique_ptr<RawConnection>> connections) {
  absl::MutexLock lock(&replica.mu);
  for (std::unique_ptr<RawConnection>& connection : connections) {
    replica.idle_spread.push_back(std::move(connection));
  }
}

void LogpClient::AskLimitsInBackground(const std::shared_ptr<Replica>& replica,
                                       const std::string& model) {
  {
    absl::MutexLock lock(&replica->mu);
    if (replica->info.has_value() || replica->asking ||
        absl::Now() < replica->ask_again) {
      return;
    }
    replica->asking = true;
  }
  // Owned by the callback, which keeps the replica alive.
  struct Ask {
    grpc::ClientContext context;
    detlogp::v1::GetModelInfoRequest request;
    detlogp::v1::ModelInfo info;
  };
  auto ask = std::make_shared<Ask>();
  PrepareContext(&ask->context);
  ask->request.set_model(model);
  replica->stub->async()->GetModelInfo(
      &ask->context, &ask->request, &ask->info,
      [replica, ask](grpc::Status status) {
        absl::MutexLock lock(&replica->mu);
        replica->asking = false;
        if (!status.ok()) {
          // Asked again by a later call, not at once by every call.
          replica->ask_again = absl::Now() + absl::Seconds(1);
          return;
        }
        replica->window.SetCapacity(ask->info.max_queue_rows());
        replica->info = std::move(ask->info);
      });
}

int64_t LogpClient::spread_connections_opened() const {
  absl::MutexLock lock(&spread_mu_);
  return spread_opened_;
}

int LogpClient::spread_connections_connected() const {
  ReplicaList replicas;
  {
    absl::MutexLock lock(&replicas_mu_);
    replicas = replicas_;
  }
  int connected = 0;
  for (const std::shared_ptr<Replica>& replica : replicas) {
    absl::MutexLock lock(&replica->mu);
    for (const std::unique_ptr<RawConnection>& connection :
         replica->idle_spread) {
      if (connection->channel->GetState(/*try_to_connect=*/false) ==
          GRPC_CHANNEL_READY) {
        ++connected;
      }
    }
  }
  return connected;
}

}  // namespace detlogp::client
