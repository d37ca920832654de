/* The C++ LogpClient (client/logp_client.h) as a small C ABI, for clients in
 * other languages: the Python client loads it with ctypes and hands it a
 * large call's rows, which it cuts, spreads over its own connections and
 * sends without the interpreter in the way (ctypes releases the GIL for the
 * call). The answer is LogpClient::Score's: checked against the request,
 * one model version for the whole call, the bits of the rows sent alone.
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
#define DETLOGP_CLIENT_ABI_VERSION 4
int detlogp_client_abi_version(void);

typedef struct DetlogpClient DetlogpClient;

typedef struct {
  const char* target;        /* "host:port", "unix:/path", "dns:///..." */
  double timeout_s;          /* per call; <= 0: LogpClient's default */
  int64_t max_message_bytes; /* <= 0: LogpClient's default */
  int connections;           /* a large call's connections; 0: automatic */
  /* A spread call's requests: hidden bytes each at most, and how many are
   * outstanding per connection at once; <= 0: LogpClient's defaults. */
  int64_t spread_request_bytes;
  int spread_requests_in_flight;
  /* Rows on a GPU go through a CUDA region the client owns on it, when the
   * server allows it (LogpClient::Options::cuda_shared_memory). */
  int cuda_shared_memory;
  const char* bearer_token; /* null or empty: none */
  /* PEM; null or empty: plaintext (roots), no client certificate. */
  const char* tls_root_certs;
  const char* tls_client_cert;
  const char* tls_client_key;
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
/* Why a shared-memory region of the client's is not used (empty while
 * nothing was refused), written NUL-terminated to `text[0, text_len)`. */
void detlogp_client_shared_memory_refusal(DetlogpClient* client, char* text,
                                          size_t text_len);
void detlogp_client_destroy(DetlogpClient* client);

#ifdef __cplusplus
}
#endif

#endif /* DETLOGP_CLIENT_CAPI_DETLOGP_CLIENT_H_ */
