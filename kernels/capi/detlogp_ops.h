/* The trainer-side ops as a small C ABI over the same kernels the
 * CPU server runs, so a caller gets the served bits. The CUDA entry points
 * live in a library of their own (detlogp_ops_cuda.h), so this one builds and
 * loads without CUDA.
 *
 * Plain C types only. Every function returns 0 on success; otherwise nonzero,
 * with a NUL-terminated message naming the bad argument written to
 * `error[0, error_len)` when `error` is not null (per call, so thread-safe).
 * Nothing is computed when an argument is rejected. */
#ifndef DETLOGP_KERNELS_CAPI_DETLOGP_OPS_H_
#define DETLOGP_KERNELS_CAPI_DETLOGP_OPS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a signature below changes. */
#define DETLOGP_OPS_ABI_VERSION 2
int detlogp_ops_abi_version(void);

/* logprobs[r] = z[targets[r]] - logsumexp(z), lse[r] = logsumexp(z) and
 * entropy[r] = -sum_v p_v log p_v (p = softmax(z)) with
 * z[v] = (hidden[r] . weight[v] + bias[v]) / temperatures[r], v < vocab_size,
 * exactly as the CPU server computes them (kernels/linear_logp_cpu.h).
 *   weight: bf16 bits [padded_vocab_size, hidden_size]; bias: fp32
 *   [padded_vocab_size] or null; 0 < vocab_size <= padded_vocab_size;
 *   hidden: bf16 bits [rows, hidden_size]; targets: [rows] in [0, vocab_size);
 *   temperatures: [rows], finite and > 0; logprobs, lse, entropy: [rows] out
 *   (lse and entropy may be null: entropy is computed only when asked);
 *   num_threads: 0 = all cores, 1 = the calling thread only. */
int detlogp_cpu_linear_logp(const uint16_t* weight, int64_t padded_vocab_size,
                            int64_t hidden_size, const float* bias,
                            int64_t vocab_size, const uint16_t* hidden,
                            int64_t rows, const int32_t* targets,
                            const float* temperatures, int num_threads,
                            float* logprobs, float* lse, float* entropy,
                            char* error, size_t error_len);

/* The H3 video input projection y[rows, 5376] = x[rows, 96] . weight^T + bias
 * in fp32 (kernels/projection.h, the CPU projection backend's kernel).
 * weight: [5376, 96]; bias: [5376] or null. */
int detlogp_cpu_h3_projection(const float* x, int64_t rows, const float* weight,
                              const float* bias, int num_threads, float* y,
                              char* error, size_t error_len);
int64_t detlogp_h3_projection_in_dim(void);
int64_t detlogp_h3_projection_out_dim(void);

/* The H3 projection's gradients in kernels/projection_grad.h's fixed order
 * (the CUDA kernels give the same bits):
 *   dx[rows, 96] = dy[rows, 5376] . weight;
 *   dweight[5376, 96] = sum_i dy[i]^T x[i] and dbias[5376] = sum_i dy[i]
 *   (dbias may be null), row i having key first_key + i (first_key >= 0). */
int detlogp_cpu_h3_projection_input_grad(const float* weight, const float* dy,
                                         int64_t rows, int num_threads,
                                         float* dx, char* error,
                                         size_t error_len);
int detlogp_cpu_h3_projection_weight_grad(const float* dy, const float* x,
                                          int64_t rows, int64_t first_key,
                                          int num_threads, float* dweight,
                                          float* dbias, char* error,
                                          size_t error_len);

/* The CPU server's determinism key ("dk1-" + 32 hex digits) for this lm_head
 * (weight/bias/vocab_size as in detlogp_cpu_linear_logp), written
 * NUL-terminated to key[0, key_len); key_len must be at least 37. */
int detlogp_cpu_determinism_key(const uint16_t* weight,
                                int64_t padded_vocab_size, int64_t hidden_size,
                                const float* bias, int64_t vocab_size,
                                char* key, size_t key_len, char* error,
                                size_t error_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DETLOGP_KERNELS_CAPI_DETLOGP_OPS_H_ */
