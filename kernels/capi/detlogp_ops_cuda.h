/* The trainer-side ops on CUDA: a small C ABI over the kernels
 * the CUDA server runs (kernels/cuda/), so a trainer gets the CUDA server's
 * bits. The linear-logp kernel is chosen as the server's --logp_kernel=auto
 * chooses it (kernels/cuda/kernel_kind.h): the Hopper kernel (sm_90a) on
 * compute capability 9.0, the portable mma.sync kernel on any other GPU of
 * compute capability >= 8.0 (no entropy there yet: refused with an error).
 * Built as its own library, libdetlogp_ops_cuda.so, so the CPU one
 * (detlogp_ops.h) builds and loads without CUDA.
 *
 * Every pointer named "device" is a CUDA device pointer on `device`; the
 * library never allocates device memory or copies a weight: the caller (e.g.
 * PyTorch's caching allocator) supplies outputs and workspace, and work is
 * enqueued on the caller's stream (a cudaStream_t passed as void*; null is
 * the legacy default stream) without synchronizing the host. Every call may
 * run while the caller's stream captures a CUDA graph (torch.cuda.graph,
 * torch.compile(mode="reduce-overhead")): launches are captured, and set-up
 * (a head's creation, a projection's kernel attributes) allocates nothing,
 * synchronizes nothing and runs with this thread's capture mode relaxed.
 *
 * Errors as in detlogp_ops.h: 0 on success, else nonzero with a
 * NUL-terminated message naming the bad argument written to
 * error[0, error_len) when error is not null. Nothing is launched when an
 * argument is rejected. Values on the device (targets, temperatures) are not
 * checked here: targets must lie in [0, vocab_size) and temperatures be
 * finite and > 0 (the Python front end checks them). */
#ifndef DETLOGP_KERNELS_CAPI_DETLOGP_OPS_CUDA_H_
#define DETLOGP_KERNELS_CAPI_DETLOGP_OPS_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a signature below changes. */
#define DETLOGP_OPS_CUDA_ABI_VERSION 3
int detlogp_ops_cuda_abi_version(void);

/* 0 when `device` is a usable GPU of compute capability >= 8.0; otherwise
 * the message says what is missing (no driver, no device, too old a GPU). */
int detlogp_cuda_check_device(int device, char* error, size_t error_len);

/* An lm_head on the GPU: wraps the caller's device tensors (no copy) and
 * holds the weight's TMA tensor map (kernels/cuda/linear_logp_cuda.h). The
 * tensors must stay allocated while the handle is used; their contents are
 * read when each launch runs, so a handle may be reused across weight
 * updates in place. Destroying a handle frees host memory only: graphs
 * captured with it keep their launch parameters.
 *   weight: device bf16 [padded_vocab_size, hidden_size] row-major, 16-byte
 *   aligned, hidden_size a multiple of 64 in [64, 65536]; bias: device fp32
 *   [padded_vocab_size] or null; 0 < vocab_size <= padded_vocab_size. */
typedef struct detlogp_cuda_lm_head detlogp_cuda_lm_head;
int detlogp_cuda_lm_head_create(const void* weight, int64_t padded_vocab_size,
                                int64_t hidden_size, const float* bias,
                                int64_t vocab_size, int device,
                                detlogp_cuda_lm_head** head, char* error,
                                size_t error_len);
void detlogp_cuda_lm_head_destroy(detlogp_cuda_lm_head* head);

/* Bytes of device workspace one launch of `rows` rows needs (4-byte
 * aligned); return_entropy != 0 counts what the entropy output needs. -1 on
 * a bad argument. */
int64_t detlogp_cuda_linear_logp_workspace_bytes(
    const detlogp_cuda_lm_head* head, int64_t rows, int return_entropy);

/* logprobs[r] = z[targets[r]] - lse[r], lse[r] = logsumexp(z) with
 * z[v] = (hidden[r] . weight[v] + bias[v]) / temperatures[r], v < vocab_size:
 * the CUDA server's bits (batch-invariant: a row's bits never depend on
 * `rows` or its neighbours). Exactly two kernels on `stream` (the vocabulary
 * splits, then their fold); nothing else is launched, filled or copied.
 *   hidden: device bf16 [rows, hidden_size], 16-byte aligned; targets: device
 *   [rows], int32 or, when targets_are_int64 != 0, int64 (read in place, no
 *   converted copy), a target outside [0, vocab_size) giving a NaN logprob;
 *   temperatures: device fp32 [rows], or null: every row's is `temperature`
 *   (finite, > 0; the same bits as an array holding it); logprobs, lse:
 *   device fp32 [rows] out (need no initial value); entropy: device fp32
 *   [rows] out, or null (not computed; asking for it never changes logprobs
 *   or lse bits); workspace: device, at least
 *   detlogp_cuda_linear_logp_workspace_bytes(head, rows, entropy != null)
 *   bytes, not used by another launch at the same time, no initial value. */
int detlogp_cuda_linear_logp(const detlogp_cuda_lm_head* head,
                             const void* hidden, int64_t rows,
                             const void* targets, int targets_are_int64,
                             const float* temperatures, float temperature,
                             float* logprobs, float* lse, float* entropy,
                             void* workspace, size_t workspace_bytes,
                             void* stream, char* error, size_t error_len);

/* The backward of detlogp_cuda_linear_logp (kernels/cuda/
 * linear_logp_backward_cuda.h; compute capability 9.0 only, a
 * head made on another GPU answers with an error): for upstream gradients
 * of logprobs, lse and entropy (each device fp32 [rows] or null: zero),
 *   grad_hidden [rows, hidden_size]    bf16 when grad_hidden_bf16, else fp32
 *   grad_weight [padded_vocab_size, hidden_size]  bf16 when
 *               grad_weight_bf16 (rows <= 16384), else fp32
 *   grad_bias   [padded_vocab_size] fp32
 * each out or null (not computed; at least one). The logits are recomputed
 * from the forward's saved `lse` (and `entropy`, needed with grad_entropy);
 * `hidden`, `targets` and the temperature are the forward's. grad_hidden of
 * a row depends only on that row and its upstream gradients; grad_weight
 * and grad_bias are the same bits run to run. No atomics; nothing is
 * allocated (design: docs/kernels.md, "Fused backward"). workspace: at least
 * detlogp_cuda_linear_logp_backward_workspace_bytes(head, rows,
 * grad_hidden_bf16 && grad_hidden, grad_bias != null), 256-byte aligned.
 * -1 from the size query on a bad argument or a head without the backward. */
int64_t detlogp_cuda_linear_logp_backward_workspace_bytes(
    const detlogp_cuda_lm_head* head, int64_t rows, int bf16_grad_hidden,
    int grad_bias);
int detlogp_cuda_linear_logp_backward(
    const detlogp_cuda_lm_head* head, const void* hidden, int64_t rows,
    const void* targets, int targets_are_int64, const float* temperatures,
    float temperature, const float* lse, const float* entropy,
    const float* grad_logprobs, const float* grad_lse,
    const float* grad_entropy, void* grad_hidden, int grad_hidden_bf16,
    void* grad_weight, int grad_weight_bf16, float* grad_bias, void* workspace,
    size_t workspace_bytes, void* stream, char* error, size_t error_len);

/* The H3 video input projection on the GPU (kernels/cuda/projection_cuda.h):
 * the same bits as the CPU ops and the server's Project, forward and
 * gradients. weight: device fp32 [5376, 96]; bias: device fp32 [5376] or
 * null; every device pointer 16-byte aligned.
 *
 * y[rows, 5376] = x[rows, 96] . weight^T + bias. workspace: at least
 * detlogp_cuda_h3_projection_forward_workspace_bytes() bytes (the weight's
 * transpose, rebuilt on the stream at every call). */
int64_t detlogp_cuda_h3_projection_forward_workspace_bytes(void);
int detlogp_cuda_h3_projection_forward(const float* x, int64_t rows,
                                       const float* weight, const float* bias,
                                       float* y, void* workspace,
                                       size_t workspace_bytes, int device,
                                       void* stream, char* error,
                                       size_t error_len);

/* dx[rows, 96] = dy[rows, 5376] . weight. workspace: at least
 * detlogp_cuda_h3_projection_input_grad_workspace_bytes(rows) bytes (may be
 * 0 and null). */
int64_t detlogp_cuda_h3_projection_input_grad_workspace_bytes(int64_t rows);
int detlogp_cuda_h3_projection_input_grad(const float* dy, int64_t rows,
                                          const float* weight, float* dx,
                                          void* workspace,
                                          size_t workspace_bytes, int device,
                                          void* stream, char* error,
                                          size_t error_len);

/* dweight[5376, 96] and dbias[5376] (or null) of one whole batch whose row i
 * has key first_key + i: the CPU's detlogp_cpu_h3_projection_weight_grad
 * bits. workspace: at least
 * detlogp_cuda_h3_projection_weight_grad_workspace_bytes(rows, first_key)
 * bytes (may be 0 and null). -1 from the size query on a bad argument. */
int64_t detlogp_cuda_h3_projection_weight_grad_workspace_bytes(
    int64_t rows, int64_t first_key);
int detlogp_cuda_h3_projection_weight_grad(
    const float* dy, const float* x, int64_t rows, int64_t first_key,
    float* dweight, float* dbias, void* workspace, size_t workspace_bytes,
    int device, void* stream, char* error, size_t error_len);

/* The determinism key ("dk1-" + 32 hex digits) a CUDA server running the
 * Hopper kernel (compute capability 9.0) reports for this lm_head, from HOST
 * copies of its bytes (weight: bf16 bits [padded_vocab_size, hidden_size];
 * bias: fp32 [padded_vocab_size] or null), as detlogp_cpu_determinism_key.
 * Needs no GPU. key_len >= 37. */
int detlogp_cuda_determinism_key(const uint16_t* weight,
                                 int64_t padded_vocab_size, int64_t hidden_size,
                                 const float* bias, int64_t vocab_size,
                                 char* key, size_t key_len, char* error,
                                 size_t error_len);
/* As detlogp_cuda_determinism_key, for the kernel `device` runs: on compute
 * capability 9.0 the same key (the Hopper kernel); on another GPU the
 * portable kernel's, which names the device's compute capability and the
 * code the driver loaded there (and the driver's version when it
 * JIT-compiled the PTX). Needs the GPU. */
int detlogp_cuda_device_determinism_key(int device, const uint16_t* weight,
                                        int64_t padded_vocab_size,
                                        int64_t hidden_size, const float* bias,
                                        int64_t vocab_size, char* key,
                                        size_t key_len, char* error,
                                        size_t error_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DETLOGP_KERNELS_CAPI_DETLOGP_OPS_CUDA_H_ */
