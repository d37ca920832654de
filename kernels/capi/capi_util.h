// Helpers shared by the C ABIs (detlogp_ops.cc, detlogp_ops_cuda.cc): error
// messages into the caller's buffer, the lm_head argument checks, and the
// determinism key of a host lm_head for a backend.
#ifndef DETLOGP_KERNELS_CAPI_CAPI_UTIL_H_
#define DETLOGP_KERNELS_CAPI_CAPI_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace detlogp::capi {

// Writes `message` NUL-terminated to error[0, error_len) (when error is not
// null) and returns 1.
int Fail(const std::string& message, char* error, size_t error_len);
void ClearError(char* error, size_t error_len);

// The lm_head arguments shared by linear_logp and the key; empty when sane.
std::string CheckHead(const void* weight, int64_t padded_vocab_size,
                      int64_t hidden_size, int64_t vocab_size);

// What names a backend's arithmetic in the server's determinism key
// (digests/determinism_key.h): its description's fields.
struct BackendIdentity {
  const char* backend = "";
  const char* instruction_set = "";
  const char* kernel_version = "";
};

// The server's key for this host lm_head under `identity` (the weights'
// digest as lm_head_weights.cc computes it, then DeterminismKey), written to
// key[0, key_len); 0 or Fail's 1.
int WriteDeterminismKey(const BackendIdentity& identity, const uint16_t* weight,
                        int64_t padded_vocab_size, int64_t hidden_size,
                        const float* bias, int64_t vocab_size, char* key,
                        size_t key_len, char* error, size_t error_len);

}  // namespace detlogp::capi

#endif  // DETLOGP_KERNELS_CAPI_CAPI_UTIL_H_
