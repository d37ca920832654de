"""Finds the lm_head in what a user points at: a Hugging Face checkpoint
directory (as save_pretrained writes it) or one .safetensors file, by the
server's rules (formats/checkpoint.h) and with its messages.

A directory holds model.safetensors or model.safetensors.index.json (whose
"weight_map" names the shard of every tensor), and config.json. The head is:
  1. the tensor the caller names, if any;
  2. lm_head.weight;
  3. when config.json says tie_word_embeddings, the input embedding under
     one of INPUT_EMBEDDING_NAMES. As vLLM reads it, text_config's flag wins
     over the top level's; absent from both means true, Hugging Face's
     default.
The bias is the tensor the caller names, else lm_head.bias when the head is
lm_head.weight and the checkpoint has one. The head's shape is checked against
config.json's hidden_size and vocab_size (also under text_config). Only the
index and the headers of the files holding the head are read here.

    head = resolve_head("/ckpt/qwen")
    head.weight_file, head.weight_tensor, head.description
"""

from __future__ import annotations

import dataclasses
import json
import os

from detlogp import safetensors_io

# The input embedding's name in the usual causal-LM families, tried in order.
INPUT_EMBEDDING_NAMES = (
    "model.embed_tokens.weight",  # Llama, Qwen, Mistral, Gemma
    "transformer.wte.weight",  # GPT-2, GPT-J
    "model.decoder.embed_tokens.weight",  # OPT
    "gpt_neox.embed_in.weight",  # GPT-NeoX, Pythia
    "transformer.word_embeddings.weight",  # BLOOM, Falcon
    "language_model.model.embed_tokens.weight",  # LLaVA-style wrappers
    "model.language_model.embed_tokens.weight",  # newer multimodal layouts
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_FLOAT_DTYPES = ("F32", "BF16", "F16")


class CheckpointError(ValueError):
    """A checkpoint whose head cannot be found or used; the message says why."""


@dataclasses.dataclass(frozen=True)
class ResolvedHead:
    weight_file: str  # the .safetensors holding the weight
    weight_tensor: str
    weight_dtype: str  # "BF16", "F16" or "F32"
    padded_vocab_size: int
    hidden_size: int
    bias_file: str | None
    bias_tensor: str | None
    tied: bool  # the input embedding serves as the head
    description: str  # which tensor of which file, for logs


@dataclasses.dataclass
class _HeadConfig:
    present: bool = False
    tie_word_embeddings: bool = True  # Hugging Face's default when absent
    hidden_size: int | None = None
    vocab_size: int | None = None


def _read_json(path):
    try:
        with open(path) as f:
            parsed = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not a JSON object: {e}") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return parsed


def _int_field(obj, keys):
    for key in keys:
        value = obj.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def _read_head_config(folder):
    config = _HeadConfig()
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.exists(path):
        return config
    parsed = _read_json(path)
    config.present = True
    text = parsed.get("text_config")
    text = text if isinstance(text, dict) else None
    # text_config's flag wins over the top level's, as vLLM reads it
    # (hf_text_config.tie_word_embeddings).
    tie = text.get("tie_word_embeddings") if text is not None else None
    if not isinstance(tie, bool):
        tie = parsed.get("tie_word_embeddings")
    config.tie_word_embeddings = tie if isinstance(tie, bool) else True
    hidden_keys = ("hidden_size", "n_embd", "d_model")
    config.hidden_size = _int_field(parsed, hidden_keys)
    if config.hidden_size is None and text is not None:
        config.hidden_size = _int_field(text, hidden_keys)
    config.vocab_size = _int_field(parsed, ("vocab_size",))
    if config.vocab_size is None and text is not None:
        config.vocab_size = _int_field(text, ("vocab_size",))
    return config


def _read_index(path):
    parsed = _read_json(path)
    weight_map = parsed.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f'{path}: no "weight_map" object')
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or file.startswith("/"):
            raise CheckpointError(f"{path}: weight_map['{name}'] is not a relative file name")
        if ".." in file.split("/"):
            raise CheckpointError(f"{path}: weight_map['{name}'] leaves the checkpoint")
    return dict(weight_map)


def _choose_head(weight_tensor, files, config, where):
    if weight_tensor:
        if weight_tensor not in files:
            raise CheckpointError(f"{where}: no tensor '{weight_tensor}'")
        return weight_tensor
    if "lm_head.weight" in files:
        return "lm_head.weight"
    if not config.present:
        raise CheckpointError(
            f"{where}: no tensor 'lm_head.weight', and no config.json to say "
            "whether tie_word_embeddings; name the head tensor"
        )
    if not config.tie_word_embeddings:
        raise CheckpointError(f"{where}: no lm_head.weight and tie_word_embeddings is false")
    for name in INPUT_EMBEDDING_NAMES:
        if name in files:
            return name
    raise CheckpointError(
        f"{where}: no lm_head.weight, tie_word_embeddings is true, and no input "
        f"embedding under a known name ({', '.join(INPUT_EMBEDDING_NAMES)}); "
        "name the head tensor"
    )


def _shard_hint(weight_tensor, file):
    folder = os.path.dirname(file) or "."
    index_path = os.path.join(folder, INDEX_NAME)
    if not os.path.exists(index_path):
        return ""
    try:
        index = _read_index(index_path)
        head = _choose_head(weight_tensor, index, _read_head_config(folder), index_path)
    except CheckpointError:
        return ""
    return (
        f"; this is one shard of a checkpoint: {INDEX_NAME} puts {head} in "
        f"{index[head]}; pass the directory {folder}"
    )


def resolve_head(path, weight_tensor=None, bias_tensor=None):
    """The head of the checkpoint directory or .safetensors file `path`
    (weight_tensor None: lm_head.weight, else the tied input embedding;
    bias_tensor None: lm_head.bias when present). Raises CheckpointError
    (FileNotFoundError for a path that does not exist)."""
    path = os.fspath(path)
    if not path:
        raise CheckpointError("weights path: empty")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: does not exist")
    weight_tensor = weight_tensor or ""
    headers = {}  # relative file name -> safetensors header
    config = _HeadConfig()
    is_dir = os.path.isdir(path)
    if is_dir:
        folder = path
        config = _read_head_config(folder)
        index_path = os.path.join(folder, INDEX_NAME)
        single_path = os.path.join(folder, SINGLE_NAME)
        if os.path.exists(index_path):
            files = _read_index(index_path)
        elif os.path.exists(single_path):
            headers[SINGLE_NAME] = safetensors_io.read_header(single_path)
            files = dict.fromkeys(headers[SINGLE_NAME], SINGLE_NAME)
        else:
            raise CheckpointError(f"{path} is a directory with no {SINGLE_NAME} or {INDEX_NAME}")
    elif path.endswith(".json"):
        index = _read_index(path)
        folder = os.path.dirname(path) or "."
        try:
            head = _choose_head(weight_tensor, index, _read_head_config(folder), path)
        except CheckpointError as e:
            raise CheckpointError(
                f"{path} is a shard index, not weights: pass the directory {folder} ({e})"
            ) from None
        raise CheckpointError(
            f"{path} is a shard index; {head} is in {index[head]}: pass the directory {folder}"
        )
    else:
        folder = os.path.dirname(path) or "."
        base = os.path.basename(path)
        headers[base] = safetensors_io.read_header(path)
        files = dict.fromkeys(headers[base], base)
        if base == SINGLE_NAME:  # beside its config.json: a one-file checkpoint
            config = _read_head_config(folder)

    try:
        head = _choose_head(weight_tensor, files, config, path)
    except CheckpointError as e:
        hint = "" if is_dir else _shard_hint(weight_tensor, path)
        raise CheckpointError(f"{e}{hint}") from None

    def header_of(relative):
        if relative not in headers:
            headers[relative] = safetensors_io.read_header(os.path.join(folder, relative))
        return headers[relative]

    info = header_of(files[head]).get(head)
    if info is None:
        raise CheckpointError(
            f"{path}: the index puts {head} in {files[head]}, which has no such tensor"
        )
    if info["dtype"] not in _FLOAT_DTYPES:
        raise CheckpointError(f"{head}: dtype {info['dtype']} is not F32, BF16 or F16")
    shape = list(info["shape"])
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        raise CheckpointError(
            f"{head}: expected a [V, H] matrix, got [{', '.join(map(str, shape))}]"
        )
    rows, hidden = shape
    if config.hidden_size is not None and config.hidden_size != hidden:
        raise CheckpointError(
            f"{head} is [{rows}, {hidden}] but config.json says hidden_size={config.hidden_size}"
        )
    if config.vocab_size is not None and config.vocab_size != rows:
        raise CheckpointError(
            f"{head} is [{rows}, {hidden}] but config.json says vocab_size={config.vocab_size}"
        )
    tied = head in INPUT_EMBEDDING_NAMES

    bias = bias_tensor or ""
    if not bias and head == "lm_head.weight" and "lm_head.bias" in files:
        bias = "lm_head.bias"
    if bias:
        if bias not in files:
            raise CheckpointError(f"{path}: no tensor '{bias}' (the bias)")
        bias_info = header_of(files[bias]).get(bias)
        if (
            bias_info is None
            or list(bias_info["shape"]) != [rows]
            or bias_info["dtype"] not in _FLOAT_DTYPES
        ):
            raise CheckpointError(f"{bias}: expected a float vector of {rows} elements")

    def location(tensor):
        return f"{files[tensor]} of {path}" if is_dir else path

    description = (
        f"{head} ({info['dtype']} [{rows}, {hidden}]"
        f"{', the tied input embedding' if tied else ''}) in {location(head)}"
    )
    if bias:
        description += f", bias {bias} in {location(bias)}"
    return ResolvedHead(
        weight_file=os.path.join(folder, files[head]),
        weight_tensor=head,
        weight_dtype=info["dtype"],
        padded_vocab_size=rows,
        hidden_size=hidden,
        bias_file=os.path.join(folder, files[bias]) if bias else None,
        bias_tensor=bias or None,
        tied=tied,
        description=description,
    )
