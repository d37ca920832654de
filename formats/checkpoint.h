// Finds the lm_head in what a user points at: a Hugging Face checkpoint
// directory (as save_pretrained writes it), or one .safetensors file.
//
// A directory holds either model.safetensors or model.safetensors.index.json
// (whose "weight_map" names the shard of every tensor), and config.json. The
// head is, in this order:
//   1. the tensor named by the caller (HeadLookup::weight_tensor), if any;
//   2. lm_head.weight;
//   3. when config.json says tie_word_embeddings, the input embedding under
//      one of kInputEmbeddingNames. As vLLM reads it, text_config's flag wins
//      over the top level's; absent from both means true, Hugging Face's
//      default.
// The bias is the tensor named by the caller, else lm_head.bias when the head
// is lm_head.weight and the checkpoint has one. The head's shape is checked
// against config.json's hidden_size and vocab_size (also under text_config).
//
// Only headers are read here: a sharded checkpoint's index and the header of
// the shard(s) holding the head; the other shards are never opened. Tensors
// that are not the head or its bias may have any dtype (int64 buffers such as
// model.position_ids are skipped).
//
// client/python/detlogp/checkpoint.py follows the same rules with the same
// messages.
#ifndef DETLOGP_FORMATS_CHECKPOINT_H_
#define DETLOGP_FORMATS_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace detlogp::formats {

// Names of the input embedding in the usual causal-LM families (Llama, Qwen,
// Mistral, Gemma; GPT-2; OPT; GPT-NeoX and Pythia; BLOOM and Falcon;
// multimodal wrappers), tried in this order when the head is tied.
extern const char* const kInputEmbeddingNames[];
extern const int kNumInputEmbeddingNames;

struct HeadLookup {
  // A checkpoint directory or a .safetensors file.
  std::string path;
  // Empty: lm_head.weight, else the tied input embedding.
  std::string weight_tensor;
  // Empty: lm_head.bias when the head is lm_head.weight and it exists.
  std::string bias_tensor;
  // When not empty, every file read must resolve (symlinks followed) inside
  // this canonical directory (LoadModel's --model_root).
  std::string confine_to;
};

struct ResolvedHead {
  std::string weight_file;  // the .safetensors holding the weight
  std::string weight_tensor;
  std::string weight_dtype;  // "BF16", "F16" or "F32"
  int64_t padded_vocab_size = 0;
  int64_t hidden_size = 0;
  std::string bias_file;  // empty: no bias
  std::string bias_tensor;
  // The input embedding serves as the head (tie_word_embeddings).
  bool tied = false;
  // What was chosen and from where, for logs: "lm_head.weight (BF16
  // [151936, 896]) in model-00003-of-00004.safetensors of /m/qwen".
  std::string description;
};

absl::StatusOr<ResolvedHead> ResolveHead(const HeadLookup& lookup);

}  // namespace detlogp::formats

#endif  // DETLOGP_FORMATS_CHECKPOINT_H_
