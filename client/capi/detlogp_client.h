/* The C++ LogpClient (client/logp_client.h) as a small C ABI, for clients in
 * other languages: the Python client loads it with ctypes and hands it every
 * call larger than one request, which it cuts, spreads over its own
 * connections (or puts in its shared-memory regions) and sends without the
 * interpreter in the way (ctypes releases the GIL for the call). The answer
 * is LogpClient::Score's: checked against the request, one model version for
 * the whole call, the bits of the rows sent alone.
 *
 * A call is made blocking (detlogp_client_score) or with a completion
 * callback (detlogp_client_score_async), run on one of the client's own
 * threads: an event loop awaits it without a thread of its own per call.
 *
 * Plain C types only. Functions returning int return 0 (OK) or a gRPC status
 * code, with a NUL-terminated message written to `error[0, error_len)` when
 * `error` is not null. A client may be used by several threads at once. */
#ifndef DETLOGP_CLIENT_CAPI_DETLOGP_CLIENT_H_
#define DETLOGP_CLIENT_CAPI_DETLOGP_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a signature or struct below changes. */
#define DETLOGP_CLIENT_ABI_VERSION 6
int detlogp_client_abi_version(void);

typedef struct DetlogpClient DetlogpClient;

/* One gRPC channel argument, by gRPC's name. Integer ones: message sizes
 * ("grpc.max_receive_message_length", "grpc.max_send_message_length"),
 * keepalive ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms",
 * "grpc.keepalive_permit_without_calls", "grpc.http2.max_pings_without_data"),
 * reconnect backoff ("grpc.initial_reconnect_backoff_ms",
 * "grpc.min_reconnect_backoff_ms", "grpc.max_reconnect_backoff_ms"); the one
 * string one: "grpc.lb_policy_name". Any other key is refused
 * (INVALID_ARGUMENT naming it). */
typedef struct {
  const char* key;
  int64_t int_value;        /* integer arguments */
  const char* string_value; /* string arguments */
} DetlogpChannelArg;

typedef struct {
  /* The servers, each "host:port", "unix:/path" or "dns:///...";
   * target_count of them (at least one). Several are replicas of one
   * model: a call's requests are spread over them, and a failed one's go to
   * another (LogpClient::Options::targets); the first also takes the
   * control calls and the rows in the client's regions. */
  const char* const* targets;
  int target_count;
  double timeout_s;          /* per call; <= 0: LogpClient's default */
  int64_t max_message_bytes; /* <= 0: LogpClient's default */
  int connections;           /* a large call's connections; 0: automatic */
  /* A spread call's requests: hidden bytes each at most, and how many are
   * outstanding per connection at once; <= 0: LogpClient's defaults. */
  int64_t spread_request_bytes;
  int spread_requests_in_flight;
  /* Host rows go through system shared-memory regions the client owns,
   * and rows on a GPU through a CUDA region the client owns on it, when the
   * server allows it (LogpClient::Options::system_shared_memory and
   * cuda_shared_memory); a refused region falls back to the messages once,
   * and the answer's path says which way the rows went. */
  int system_shared_memory;
  int cuda_shared_memory;
  const DetlogpChannelArg* channel_args; /* [channel_arg_count] */
  int channel_arg_count;
  /* detlogp_client_score_async calls run at once on the client's threads
   * (more wait their turn); <= 0: 8. */
  int async_threads;
  const char* bearer_token; /* null or empty: none */
  /* PEM; null or empty: plaintext (roots), no client certificate. */
  const char* tls_root_certs;
  const char* tls_client_cert;
  const char* tls_client_key;
  /* Hidden bytes per piece, at least, of a call written into the client's
   * system region (LogpClient::Options::region_piece_bytes); <= 0: its
   * default. */
  int64_t region_piece_bytes;
} DetlogpClientOptions;

typedef struct {
  const char* request_id; /* null: "" */
  int dtype;              /* detlogp.v1.DType */
  int64_t rows;
  int64_t hidden_size;
  /* rows * hidden_size little-endian elements of dtype, row-major; read
   * only during the call. Host memory when device < 0; else memory on CUDA
   * device `device`, written on `stream` (a cudaStream_t; null: the legacy
   * default stream), which the call copies on and waits for. */
  const void* hidden;
  int device;
  void* stream;
  const int64_t* target_ids; /* [rows] */
  float temperature;         /* 0: 1 */
  int return_lse;
  int return_entropy;
  int return_timing;
  int64_t top_k;
  const char* model; /* null or empty: the server's default */
  int64_t model_version;
  /* This call's seconds, every request it is cut into included; <= 0 or
   * beyond the client's timeout_s: the client's. */
  double timeout_s;
} DetlogpScoreRequest;

typedef struct {
  /* The caller's arrays: logprobs [rows]; lse and entropy [rows] when asked
   * for; top_ids and top_logprobs [rows * top_k] when top_k > 0. */
  float* logprobs;
  float* lse;
  float* entropy;
  int64_t* top_ids;
  float* top_logprobs;
  /* Filled in. */
  int64_t model_version;
  int64_t requests;    /* requests the call was cut into */
  int32_t connections; /* connections they went over */
  int32_t server_reported_timing;
  /* Summed over the requests (ServerTiming). */
  int64_t validate_us;
  int64_t queue_us;
  int64_t compute_us;
  int64_t total_us;
  char model[256];
  char determinism_key[128];
  char path[16]; /* ScoreResult::path: "grpc", "system_shm", "cuda_shm" */
  /* The region path the server refused at registration, the rows then
   * taking `path` ("system_shm", "cuda_shm"; empty: none refused). */
  char path_refused[16];
  /* Requests refused for a full queue and sent again. */
  int64_t queue_full_retries;
  /* When the call fails with a status that has details (every status the
   * server sends, and the client's own DEADLINE_EXCEEDED): the serialized
   * google.rpc.Status (code, details; docs/api.md, "Error details"), else
   * error_details_len is 0. */
  int64_t error_details_len;
  unsigned char error_details[4096];
} DetlogpScoreAnswer;

int detlogp_client_create(const DetlogpClientOptions* options,
                          DetlogpClient** client, char* error,
                          size_t error_len);
/* One logprobs call (LogpClient::Score). Nothing is written to the answer's
 * arrays unless the call succeeds. */
int detlogp_client_score(DetlogpClient* client,
                         const DetlogpScoreRequest* request,
                         DetlogpScoreAnswer* answer, char* error,
                         size_t error_len);
/* Called once when an asynchronous call ends, on one of the client's
 * threads: `code` and `message` as detlogp_client_score returns and writes
 * them (message valid during the call only), the answer filled in as
 * detlogp_client_score fills it. It must not block for long (it holds one
 * of the client's threads). */
typedef void (*DetlogpScoreDone)(void* user_data, int code,
                                 const char* message);
/* detlogp_client_score without waiting: 0 when the call was taken, and
 * `done(user_data, ...)` follows exactly once; otherwise the status, and
 * `done` is never called. The request, the answer and every array and
 * string they point to must stay as they are until `done` is called. */
int detlogp_client_score_async(DetlogpClient* client,
                               const DetlogpScoreRequest* request,
                               DetlogpScoreAnswer* answer,
                               DetlogpScoreDone done, void* user_data,
                               char* error, size_t error_len);
/* Why a shared-memory region of the client's is not used (empty while
 * nothing was refused), written NUL-terminated to `text[0, text_len)`. */
void detlogp_client_shared_memory_refusal(DetlogpClient* client, char* text,
                                          size_t text_len);
/* Waits for the client's asynchronous calls (their callbacks run first),
 * then frees it: unregisters its regions and closes its connections. */
void detlogp_client_destroy(DetlogpClient* client);

#ifdef __cplusplus
}
#endif

#endif /* DETLOGP_CLIENT_CAPI_DETLOGP_CLIENT_H_ */
