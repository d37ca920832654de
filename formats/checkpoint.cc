#include "formats/checkpoint.h"

#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "formats/safetensors.h"

namespace detlogp::formats {

const char* const kInputEmbeddingNames[] = {
    "model.embed_tokens.weight",                 // Llama, Qwen, Mistral, Gemma
    "transformer.wte.weight",                    // GPT-2, GPT-J
    "model.decoder.embed_tokens.weight",         // OPT
    "gpt_neox.embed_in.weight",                  // GPT-NeoX, Pythia
    "transformer.word_embeddings.weight",        // BLOOM, Falcon
    "language_model.model.embed_tokens.weight",  // LLaVA-style wrappers
    "model.language_model.embed_tokens.weight",  // newer multimodal layouts
};
const int kNumInputEmbeddingNames =
    sizeof(kInputEmbeddingNames) / sizeof(kInputEmbeddingNames[0]);

namespace {

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";
constexpr char kConfigName[] = "config.json";
constexpr char kLmHeadWeight[] = "lm_head.weight";
constexpr char kLmHeadBias[] = "lm_head.bias";

using google::protobuf::Struct;
using google::protobuf::Value;

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string Dirname(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string Basename(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string Join(const std::string& dir, const std::string& name) {
  return absl::EndsWith(dir, "/") ? dir + name : absl::StrCat(dir, "/", name);
}

absl::StatusOr<Struct> ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream text;
  text << in.rdbuf();
  Struct parsed;
  const auto parsed_status =
      google::protobuf::util::JsonStringToMessage(text.str(), &parsed);
  if (!parsed_status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a JSON object: ", parsed_status.ToString()));
  }
  return parsed;
}

// What config.json says about the head.
struct HeadConfig {
  bool present = false;
  bool tie_word_embeddings = true;  // Hugging Face's default when absent
  std::optional<int64_t> hidden_size;
  std::optional<int64_t> vocab_size;
};

std::optional<int64_t> IntField(const Struct& object,
                                std::initializer_list<const char*> keys) {
  for (const char* key : keys) {
    auto it = object.fields().find(key);
    if (it != object.fields().end() &&
        it->second.kind_case() == Value::kNumberValue) {
      return static_cast<int64_t>(it->second.number_value());
    }
  }
  return std::nullopt;
}

std::optional<bool> BoolField(const Struct& object, const char* key) {
  auto it = object.fields().find(key);
  if (it == object.fields().end() ||
      it->second.kind_case() != Value::kBoolValue) {
    return std::nullopt;
  }
  return it->second.bool_value();
}

absl::StatusOr<HeadConfig> ReadHeadConfig(const std::string& dir) {
  HeadConfig config;
  const std::string path = Join(dir, kConfigName);
  if (!Exists(path)) return config;
  auto json = ReadJson(path);
  if (!json.ok()) return json.status();
  config.present = true;
  const Struct* text_config = nullptr;
  auto it = json->fields().find("text_config");
  if (it != json->fields().end() &&
      it->second.kind_case() == Value::kStructValue) {
    text_config = &it->second.struct_value();
  }
  // The text config's flag wins over the top level's, as vLLM reads it
  // (hf_text_config.tie_word_embeddings): a multimodal wrapper's top-level
  // flag describes the wrapper, not the language model whose head is served.
  std::optional<bool> tie;
  if (text_config != nullptr) {
    tie = BoolField(*text_config, "tie_word_embeddings");
  }
  if (!tie.has_value()) tie = BoolField(*json, "tie_word_embeddings");
  config.tie_word_embeddings = tie.value_or(true);
  // Sizes: the top level first; multimodal configs keep them under
  // text_config.
  const auto hidden_keys = {"hidden_size", "n_embd", "d_model"};
  config.hidden_size = IntField(*json, hidden_keys);
  if (!config.hidden_size.has_value() && text_config != nullptr) {
    config.hidden_size = IntField(*text_config, hidden_keys);
  }
  config.vocab_size = IntField(*json, {"vocab_size"});
  if (!config.vocab_size.has_value() && text_config != nullptr) {
    config.vocab_size = IntField(*text_config, {"vocab_size"});
  }
  return config;
}

// Every tensor's name and the file (relative to the checkpoint) holding it.
using TensorFiles = std::map<std::string, std::string>;

absl::StatusOr<TensorFiles> ReadIndex(const std::string& path) {
  auto json = ReadJson(path);
  if (!json.ok()) return json.status();
  auto it = json->fields().find("weight_map");
  if (it == json->fields().end() ||
      it->second.kind_case() != Value::kStructValue) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no \"weight_map\" object"));
  }
  TensorFiles files;
  for (const auto& [name, file] : it->second.struct_value().fields()) {
    if (file.kind_case() != Value::kStringValue ||
        file.string_value().empty() || file.string_value()[0] == '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": weight_map['", name, "'] is not a relative file name"));
    }
    for (absl::string_view part : absl::StrSplit(file.string_value(), '/')) {
      if (part == "..") {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": weight_map['", name, "'] leaves the checkpoint"));
      }
    }
    files.emplace(name, file.string_value());
  }
  return files;
}

absl::Status CheckConfined(const std::string& path,
                           const std::string& confine_to) {
  if (confine_to.empty()) return absl::OkStatus();
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) {
    return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  if (!absl::StartsWith(resolved, confine_to + "/")) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, " leads outside --model_root through a symlink"));
  }
  return absl::OkStatus();
}

bool IsFloatDtype(const std::string& dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16";
}

// Which tensor is the head, by the rules in checkpoint.h. `where` names the
// checkpoint in messages.
absl::StatusOr<std::string> ChooseHead(const HeadLookup& lookup,
                                       const TensorFiles& files,
                                       const HeadConfig& config,
                                       const std::string& where) {
  if (!lookup.weight_tensor.empty()) {
    if (files.count(lookup.weight_tensor) == 0) {
      return absl::NotFoundError(
          absl::StrCat(where, ": no tensor '", lookup.weight_tensor, "'"));
    }
    return lookup.weight_tensor;
  }
  if (files.count(kLmHeadWeight) != 0) return std::string(kLmHeadWeight);
  if (!config.present) {
    return absl::NotFoundError(absl::StrCat(
        where,
        ": no tensor 'lm_head.weight', and no config.json to say whether "
        "tie_word_embeddings; name the head tensor"));
  }
  if (!config.tie_word_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": no lm_head.weight and tie_word_embeddings is false"));
  }
  for (int i = 0; i < kNumInputEmbeddingNames; ++i) {
    if (files.count(kInputEmbeddingNames[i]) != 0) {
      return std::string(kInputEmbeddingNames[i]);
    }
  }
  std::vector<std::string> tried(
      kInputEmbeddingNames, kInputEmbeddingNames + kNumInputEmbeddingNames);
  return absl::NotFoundError(absl::StrCat(
      where,
      ": no lm_head.weight, tie_word_embeddings is true, and no input "
      "embedding under a known name (",
      absl::StrJoin(tried, ", "), "); name the head tensor"));
}

// A file given on its own that is one shard of a checkpoint: where the head
// really is, to say so.
std::string ShardHint(const HeadLookup& lookup, const std::string& file) {
  const std::string dir = Dirname(file);
  const std::string index_path = Join(dir, kIndexName);
  if (!Exists(index_path)) return "";
  auto index = ReadIndex(index_path);
  auto config = ReadHeadConfig(dir);
  if (!index.ok() || !config.ok()) return "";
  auto head = ChooseHead(lookup, *index, *config, index_path);
  if (!head.ok()) return "";
  return absl::StrCat("; this is one shard of a checkpoint: ", kIndexName,
                      " puts ", *head, " in ", index->at(*head),
                      "; pass the directory ", dir);
}

}  // namespace

absl::StatusOr<ResolvedHead> ResolveHead(const HeadLookup& lookup) {
  if (lookup.path.empty()) {
    return absl::InvalidArgumentError("weights path: empty");
  }
  if (!Exists(lookup.path)) {
    return absl::NotFoundError(absl::StrCat(lookup.path, ": does not exist"));
  }
  std::string checkpoint_dir;  // relative file names are under it
  TensorFiles files;
  HeadConfig config;
  std::optional<SafetensorsFile> single;  // a file whose header is read
  std::string where = lookup.path;
  if (IsDirectory(lookup.path)) {
    checkpoint_dir = lookup.path;
    auto read_config = ReadHeadConfig(checkpoint_dir);
    if (!read_config.ok()) return read_config.status();
    config = *read_config;
    const std::string index_path = Join(checkpoint_dir, kIndexName);
    const std::string single_path = Join(checkpoint_dir, kSingleName);
    if (Exists(index_path)) {
      if (absl::Status s = CheckConfined(index_path, lookup.confine_to);
          !s.ok()) {
        return s;
      }
      auto index = ReadIndex(index_path);
      if (!index.ok()) return index.status();
      files = *std::move(index);
    } else if (Exists(single_path)) {
      files.clear();
      if (absl::Status s = CheckConfined(single_path, lookup.confine_to);
          !s.ok()) {
        return s;
      }
      auto file = SafetensorsFile::Open(single_path);
      if (!file.ok()) return file.status();
      for (const auto& [name, info] : file->tensors())
        files[name] = kSingleName;
      single = *std::move(file);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(lookup.path, " is a directory with no ", kSingleName,
                       " or ", kIndexName));
    }
  } else if (absl::EndsWith(lookup.path, ".json")) {
    // An index given as if it were weights: say where the head is.
    auto index = ReadIndex(lookup.path);
    if (!index.ok()) return index.status();
    const std::string dir = Dirname(lookup.path);
    auto dir_config = ReadHeadConfig(dir);
    if (!dir_config.ok()) return dir_config.status();
    auto head = ChooseHead(lookup, *index, *dir_config, lookup.path);
    if (!head.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(lookup.path,
                       " is a shard index, not weights: pass the "
                       "directory ",
                       dir, " (", head.status().message(), ")"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(lookup.path, " is a shard index; ", *head, " is in ",
                     index->at(*head), ": pass the directory ", dir));
  } else {
    checkpoint_dir = Dirname(lookup.path);
    if (absl::Status s = CheckConfined(lookup.path, lookup.confine_to);
        !s.ok()) {
      return s;
    }
    auto file = SafetensorsFile::Open(lookup.path);
    if (!file.ok()) return file.status();
    const std::string base = Basename(lookup.path);
    for (const auto& [name, info] : file->tensors()) files[name] = base;
    single = *std::move(file);
    // A model.safetensors beside its config.json is a one-file checkpoint.
    if (base == kSingleName) {
      auto read_config = ReadHeadConfig(checkpoint_dir);
      if (!read_config.ok()) return read_config.status();
      config = *read_config;
    }
  }

  auto head = ChooseHead(lookup, files, config, where);
  if (!head.ok()) {
    if (!IsDirectory(lookup.path)) {
      const std::string hint = ShardHint(lookup, lookup.path);
      if (!hint.empty()) {
        return absl::Status(head.status().code(),
                            absl::StrCat(head.status().message(), hint));
      }
    }
    return head.status();
  }

  // Headers of the files holding the head and its bias; nothing else.
  std::map<std::string, SafetensorsFile> opened;
  const auto header_of =
      [&](const std::string& relative) -> absl::StatusOr<SafetensorsFile*> {
    auto it = opened.find(relative);
    if (it != opened.end()) return &it->second;
    if (single.has_value()) {
      return &opened.emplace(relative, *single).first->second;
    }
    const std::string path = Join(checkpoint_dir, relative);
    if (absl::Status s = CheckConfined(path, lookup.confine_to); !s.ok()) {
      return s;
    }
    auto file = SafetensorsFile::Open(path);
    if (!file.ok()) return file.status();
    return &opened.emplace(relative, *std::move(file)).first->second;
  };

  ResolvedHead resolved;
  resolved.weight_tensor = *head;
  resolved.weight_file = Join(checkpoint_dir, files.at(*head));
  auto weight_header = header_of(files.at(*head));
  if (!weight_header.ok()) return weight_header.status();
  auto info_it = (*weight_header)->tensors().find(*head);
  if (info_it == (*weight_header)->tensors().end()) {
    return absl::DataLossError(absl::StrCat(where, ": the index puts ", *head,
                                            " in ", files.at(*head),
                                            ", which has no such tensor"));
  }
  const SafetensorInfo& info = info_it->second;
  if (!IsFloatDtype(info.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        *head, ": dtype ", info.dtype, " is not F32, BF16 or F16"));
  }
  if (info.shape.size() != 2 || info.shape[0] <= 0 || info.shape[1] <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(*head, ": expected a [V, H] matrix, got [",
                     absl::StrJoin(info.shape, ", "), "]"));
  }
  resolved.weight_dtype = info.dtype;
  resolved.padded_vocab_size = info.shape[0];
  resolved.hidden_size = info.shape[1];
  if (config.hidden_size.has_value() &&
      *config.hidden_size != resolved.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        *head, " is [", resolved.padded_vocab_size, ", ", resolved.hidden_size,
        "] but config.json says hidden_size=", *config.hidden_size));
  }
  if (config.vocab_size.has_value() &&
      *config.vocab_size != resolved.padded_vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        *head, " is [", resolved.padded_vocab_size, ", ", resolved.hidden_size,
        "] but config.json says vocab_size=", *config.vocab_size));
  }
  for (int i = 0; i < kNumInputEmbeddingNames; ++i) {
    resolved.tied = resolved.tied || *head == kInputEmbeddingNames[i];
  }

  std::string bias = lookup.bias_tensor;
  if (bias.empty() && *head == kLmHeadWeight && files.count(kLmHeadBias) != 0) {
    bias = kLmHeadBias;
  }
  if (!bias.empty()) {
    auto bias_file = files.find(bias);
    if (bias_file == files.end()) {
      return absl::NotFoundError(
          absl::StrCat(where, ": no tensor '", bias, "' (the bias)"));
    }
    auto bias_header = header_of(bias_file->second);
    if (!bias_header.ok()) return bias_header.status();
    auto bias_info = (*bias_header)->tensors().find(bias);
    if (bias_info == (*bias_header)->tensors().end() ||
        bias_info->second.shape.size() != 1 ||
        bias_info->second.shape[0] != resolved.padded_vocab_size ||
        !IsFloatDtype(bias_info->second.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(bias, ": expected a float vector of ",
                       resolved.padded_vocab_size, " elements"));
    }
    resolved.bias_tensor = bias;
    resolved.bias_file = Join(checkpoint_dir, bias_file->second);
  }

  // "<tensor> in <shard> of <dir>" for a checkpoint, "in <file>" for a file.
  const bool is_dir = IsDirectory(lookup.path);
  const auto location = [&](const std::string& tensor) {
    return is_dir ? absl::StrCat(files.at(tensor), " of ", lookup.path)
                  : lookup.path;
  };
  resolved.description =
      absl::StrCat(resolved.weight_tensor, " (", resolved.weight_dtype, " [",
                   resolved.padded_vocab_size, ", ", resolved.hidden_size, "]",
                   resolved.tied ? ", the tied input embedding" : "", ") in ",
                   location(resolved.weight_tensor));
  if (!resolved.bias_tensor.empty()) {
    absl::StrAppend(&resolved.description, ", bias ", resolved.bias_tensor,
                    " in ", location(resolved.bias_tensor));
  }
  return resolved;
}

}  // namespace detlogp::formats
