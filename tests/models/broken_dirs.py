"""A corpus of broken model directories, each made from the stories260K fixture by one
ordinary kind of damage, with the words its error message must contain.

``CASES`` maps a case id to (damage, fragments). ``damage(model_dir)`` damages a fresh
copy of stories260K in place and returns the model argument to pass (usually the
directory itself). Fragments are matched against the output with whitespace collapsed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

Damage = Callable[[Path], Path]
WEIGHTS = "model.safetensors"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def edit_json(name: str, **changes: Any) -> Damage:
    """Set keys of a JSON file (a value of ``...`` deletes the key)."""

    def damage(model_dir: Path) -> Path:
        path = model_dir / name
        content = json.loads(path.read_text())
        for key, value in changes.items():
            if value is ...:
                content.pop(key, None)
            else:
                content[key] = value
        path.write_text(json.dumps(content))
        return model_dir

    return damage


def config(**changes: Any) -> Damage:
    return edit_json("config.json", **changes)


def write(name: str, content: str | bytes) -> Damage:
    def damage(model_dir: Path) -> Path:
        path = model_dir / name
        path.unlink(missing_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return model_dir

    return damage


def delete(*names: str) -> Damage:
    def damage(model_dir: Path) -> Path:
        for name in names:
            (model_dir / name).unlink()
        return model_dir

    return damage


def both(*damages: Damage) -> Damage:
    def damage(model_dir: Path) -> Path:
        for one in damages:
            one(model_dir)
        return model_dir

    return damage


def truncate(name: str, size: int) -> Damage:
    def damage(model_dir: Path) -> Path:
        with open(model_dir / name, "r+b") as file:
            file.truncate(size)
        return model_dir

    return damage


def append(name: str, extra: bytes) -> Damage:
    def damage(model_dir: Path) -> Path:
        with open(model_dir / name, "ab") as file:
            file.write(extra)
        return model_dir

    return damage


def split_file(path: Path) -> tuple[bytes, bytes]:
    """A safetensors file's header bytes and data bytes."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + length], data[8 + length :]


def edit_header(edit: Callable[[dict], Any], name: str = WEIGHTS) -> Damage:
    """Rewrite the JSON header of a safetensors file (the data stays as it is)."""

    def damage(model_dir: Path) -> Path:
        path = model_dir / name
        header_bytes, data = split_file(path)
        header = json.loads(header_bytes)
        header = edit(header) or header
        new = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(new)) + new + data)
        return model_dir

    return damage


def raw_header(replace: Callable[[bytes], bytes]) -> Damage:
    """Replace the header bytes, keeping their length (so the data stays in place)."""

    def damage(model_dir: Path) -> Path:
        path = model_dir / WEIGHTS
        header_bytes, data = split_file(path)
        new = replace(header_bytes).ljust(len(header_bytes))[: len(header_bytes)]
        path.write_bytes(struct.pack("<Q", len(header_bytes)) + new + data)
        return model_dir

    return damage


def set_entry(tensor: str, **fields: Any) -> Damage:
    return edit_header(lambda header: header[tensor].update(fields))


def rewrite_tensors(edit: Callable[[dict], None]) -> Damage:
    """Load the weights with safetensors, edit the dict, save them again (a valid file)."""

    def damage(model_dir: Path) -> Path:
        from safetensors.torch import load_file, save_file

        tensors = load_file(model_dir / WEIGHTS)
        edit(tensors)
        save_file(tensors, model_dir / WEIGHTS, metadata={"format": "pt"})
        return model_dir

    return damage


def shard(then: Damage | None = None, overlap: bool = False) -> Damage:
    """Split the weights into two shards with an index (as save_pretrained does), then
    apply ``then``. ``overlap``: both shards also hold model.norm.weight."""

    def damage(model_dir: Path) -> Path:
        from safetensors.torch import load_file, save_file

        tensors = load_file(model_dir / WEIGHTS)
        (model_dir / WEIGHTS).unlink()
        names = sorted(tensors)
        halves = (names[: len(names) // 2], names[len(names) // 2 :])
        weight_map = {}
        for shard_name, part in zip(SHARDS, halves):
            chosen = {n: tensors[n] for n in part}
            if overlap:
                chosen["model.norm.weight"] = tensors["model.norm.weight"]
            save_file(chosen, model_dir / shard_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, shard_name))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (model_dir / INDEX).write_text(json.dumps(index))
        return then(model_dir) if then else model_dir

    return damage


def move_in_index(tensor: str) -> Damage:
    def damage(model_dir: Path) -> Path:
        index = json.loads((model_dir / INDEX).read_text())
        current = index["weight_map"][tensor]
        index["weight_map"][tensor] = SHARDS[1] if current == SHARDS[0] else SHARDS[0]
        (model_dir / INDEX).write_text(json.dumps(index))
        return model_dir

    return damage


def dangling_link(model_dir: Path) -> Path:
    """A Hugging Face cache snapshot whose blob never arrived."""
    (model_dir / WEIGHTS).unlink()
    os.symlink(model_dir / "blobs" / "0123abcd", model_dir / WEIGHTS)
    return model_dir


def extra_added_token(model_dir: Path) -> Path:
    """A tokenizer with one token more than the model's embeddings have rows."""
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    token = dict(tokenizer["added_tokens"][0], id=512, content="<|extra|>")
    tokenizer["added_tokens"].append(token)
    path.write_text(json.dumps(tokenizer))
    return model_dir


def gguf_file(model_dir: Path) -> Path:
    """A file that starts like a GGUF, with version 0 (tests/gguf has the GGUF corpus)."""
    path = model_dir / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def weights_file(model_dir: Path) -> Path:
    """The weights file given instead of its directory."""
    return model_dir / WEIGHTS


def missing_dir(model_dir: Path) -> Path:
    return model_dir / "no-such-model"


NO_HEAD_DIM = ...
LAYER2_DOWN = "model.layers.2.mlp.down_proj.weight"

# id → (damage, fragments the error must contain)
CASES: dict[str, tuple[Damage, list[str]]] = {
    # a GGUF file (more in tests/gguf/broken_gguf.py)
    "gguf-version-0": (gguf_file, ["model.gguf is GGUF version 0", "convert it again"]),
    # the weights file itself
    "truncated-weights": (
        truncate(WEIGHTS, 500_000),
        ["model.safetensors is truncated", "500,000 bytes", "1,044,992 bytes"],
    ),
    "empty-weights": (write(WEIGHTS, b""), ["model.safetensors is empty (0 bytes)"]),
    "three-byte-weights": (write(WEIGHTS, b"abc"), ["model.safetensors has only 3 bytes"]),
    "impossible-header-length": (
        lambda d: write(WEIGHTS, struct.pack("<Q", 2**40) + (d / WEIGHTS).read_bytes()[8:])(d),
        ["model.safetensors is truncated or not a safetensors file", "1,099,511,627,776-byte"],
    ),
    "header-not-json": (
        raw_header(lambda b: b"{not json" + b[9:]),
        ["model.safetensors is damaged or not a safetensors file", "not valid JSON"],
    ),
    "header-not-an-object": (raw_header(lambda b: b"[1, 2]"), ["header is not a JSON object"]),
    "trailing-bytes": (append(WEIGHTS, bytes(16)), ["model.safetensors is damaged", "16 more"]),
    "unknown-dtype": (
        set_entry("model.norm.weight", dtype="Q4"),
        ["model.safetensors is damaged", "'model.norm.weight'", "unknown dtype 'Q4'"],
    ),
    "shape-disagrees-with-offsets": (
        set_entry("model.norm.weight", shape=[65]),
        ["model.safetensors is damaged", "'model.norm.weight'", "F32 [65] (260 bytes)"],
    ),
    "overlapping-data": (
        set_entry("model.norm.weight", data_offsets=[0, 256]),
        ["model.safetensors is damaged", "overlapping or missing data"],
    ),
    "int8-tensor": (
        rewrite_tensors(
            lambda t: t.update({LAYER2_DOWN: t[LAYER2_DOWN].to(dtype=__import__("torch").int8)})
        ),
        ["1 tensor(s) are stored as I8", LAYER2_DOWN, "quantized"],
    ),
    "missing-tensor": (
        rewrite_tensors(lambda t: t.pop(LAYER2_DOWN)),
        ["the weights lack 1 tensor(s)", LAYER2_DOWN],
    ),
    "unexpected-tensor": (
        rewrite_tensors(
            lambda t: t.update(
                {"model.layers.0.self_attn.q_proj.bias": t["model.norm.weight"].clone()}
            )
        ),
        ["has no place for", "model.layers.0.self_attn.q_proj.bias"],
    ),
    "no-weights": (delete(WEIGHTS), ["has no safetensors weights"]),
    "bin-only": (
        both(delete(WEIGHTS), write("pytorch_model.bin", b"PK")),
        ["pytorch_model.bin: convert it to safetensors"],
    ),
    "dangling-link": (dangling_link, ["model.safetensors is a link to a missing file"]),
    # config.json against the weights
    "vocab-size-disagrees": (
        config(vocab_size=1024),
        ["model.embed_tokens.weight is [512, 64]", "[1024, 64] (vocab_size x hidden_size)"],
    ),
    "hidden-size-disagrees": (
        config(hidden_size=128),
        ["do not match", "model.embed_tokens.weight is [512, 64]", "[512, 128]"],
    ),
    "intermediate-size-disagrees": (
        config(intermediate_size=256),
        ["mlp.gate_proj.weight is [172, 64]", "[256, 64] (intermediate_size x hidden_size)"],
    ),
    "kv-heads-disagree": (
        config(num_key_value_heads=2),
        ["k_proj.weight is [32, 64]", "(num_key_value_heads x head_dim x hidden_size)"],
    ),
    "fewer-layers-in-config": (
        config(num_hidden_layers=4),
        ["has no place for", "the weights have 5 layers, config.json says num_hidden_layers 4"],
    ),
    "more-layers-in-config": (
        config(num_hidden_layers=6),
        ["the weights lack 9 tensor(s)", "model.layers.5."],
    ),
    "untied-without-lm-head": (
        config(tie_word_embeddings=False),
        ["the weights lack 1 tensor(s)", "lm_head.weight"],
    ),
    # sharded checkpoints
    "missing-shard": (
        shard(delete(SHARDS[1])),
        ["1 of the 2 shards listed in model.safetensors.index.json are missing", SHARDS[1]],
    ),
    "truncated-shard": (shard(truncate(SHARDS[0], 1000)), [f"{SHARDS[0]} is truncated"]),
    "index-not-json": (shard(write(INDEX, '{"weight_map": {')), [f"{INDEX} is not valid JSON"]),
    "index-without-weight-map": (
        shard(write(INDEX, '{"metadata": {}}')),
        [f"{INDEX} is not a valid safetensors index", "'weight_map'"],
    ),
    "index-lists-nothing": (shard(write(INDEX, '{"weight_map": {}}')), ["lists no tensors"]),
    "index-names-wrong-shard": (
        shard(move_in_index("model.norm.weight")),
        ["places 1 tensor(s) in shards that do not hold them", "model.norm.weight"],
    ),
    "shards-overlap": (shard(overlap=True), ["repeats model.norm.weight"]),
    # config.json values
    "rope-theta-a-string": (
        config(rope_theta="10000", rope_parameters={"rope_type": "default", "rope_theta": "10000"}),
        ["config.json: 'rope_theta' must be a positive number, got the string '10000'"],
    ),
    "nested-rope-theta-a-string": (
        config(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
        ["'rope_parameters.rope_theta' must be a positive number, got the string '1e4'"],
    ),
    "rope-theta-nan": (
        config(rope_theta=float("nan"), rope_parameters=None),
        ["'rope_theta' must be a positive number, got nan"],
    ),
    "rope-thetas-disagree": (config(rope_theta=500000.0), ["disagree"]),
    "rope-scaling-unknown": (
        config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
        ["rope scaling type 'yarn' is not supported"],
    ),
    "heads-do-not-divide-hidden": (
        config(num_attention_heads=6, num_key_value_heads=3, head_dim=NO_HEAD_DIM),
        ["hidden_size (64) is not divisible by num_attention_heads (6)"],
    ),
    "heads-not-a-multiple-of-kv-heads": (
        config(num_key_value_heads=3),
        ["num_attention_heads (8) must be a multiple of num_key_value_heads (3)"],
    ),
    "heads-do-not-match-weights": (
        config(num_attention_heads=4, num_key_value_heads=2),
        ["q_proj.weight is [64, 64]", "[32, 64] (num_attention_heads x head_dim x hidden_size)"],
    ),
    "zero-heads": (
        config(num_attention_heads=0),
        ["'num_attention_heads' must be a positive integer, got 0"],
    ),
    "odd-head-dim": (config(head_dim=7), ["the head size (7) must be even"]),
    "hidden-size-a-string": (
        config(hidden_size="64"),
        ["'hidden_size' must be a positive integer, got the string '64'"],
    ),
    "negative-vocab": (
        config(vocab_size=-512),
        ["'vocab_size' must be a positive integer, got -512"],
    ),
    "tie-embeddings-a-string": (
        config(tie_word_embeddings="false"),
        ["'tie_word_embeddings' must be true or false, got the string 'false'"],
    ),
    "no-architectures": (config(architectures=...), ["'architectures' must name the model class"]),
    "architectures-a-string": (
        config(architectures="LlamaForCausalLM"),
        ["'architectures' must name the model class", "got the string 'LlamaForCausalLM'"],
    ),
    "eos-outside-vocab": (config(eos_token_id=600), ["eos_token_id 600 is outside the vocabulary"]),
    "eos-a-string": (config(eos_token_id="2"), ["'eos_token_id' must be a token id"]),
    "dtype-unknown": (
        config(torch_dtype="int4", dtype="int4"),
        ["config.json: torch_dtype 'int4' is not supported"],
    ),
    "zero-context": (
        config(max_position_embeddings=0),
        ["'max_position_embeddings' must be a positive integer, got 0"],
    ),
    "negative-norm-eps": (
        config(rms_norm_eps=-1),
        ["'rms_norm_eps' must be a positive number, got -1"],
    ),
    "quantized": (
        config(quantization_config={"quant_method": "gptq", "bits": 4}),
        ["quantized checkpoints (gptq) are not supported"],
    ),
    "generation-config-not-json": (
        write("generation_config.json", "{"),
        ["generation_config.json is not valid JSON"],
    ),
    # tokenizer files
    "tokenizer-not-json": (
        lambda d: write("tokenizer.json", (d / "tokenizer.json").read_text()[:5000])(d),
        ["tokenizer.json is not valid JSON"],
    ),
    "tokenizer-unquoted-key": (
        write("tokenizer.json", '{1: "a"}'),
        ["tokenizer.json is not valid JSON"],
    ),
    "tokenizer-binary": (
        write("tokenizer.json", bytes(range(256))),
        ["tokenizer.json is not valid JSON"],
    ),
    "tokenizer-not-a-tokenizer": (
        write("tokenizer.json", '{"model": 3}'),
        ["tokenizer.json is not a tokenizer the tokenizers library can read"],
    ),
    "no-tokenizer": (delete("tokenizer.json"), ["has no tokenizer.json"]),
    "tokenizer-bigger-than-vocab": (
        extra_added_token,
        ["tokenizer.json has token ids up to 512", "vocab_size 512"],
    ),
    "tokenizer-config-not-json": (
        write("tokenizer_config.json", "{'bos_token': '<s>'}"),
        ["tokenizer_config.json is not valid JSON"],
    ),
    "bos-token-a-number": (
        edit_json("tokenizer_config.json", bos_token=5),
        ["tokenizer_config.json: 'bos_token' must be a token (a string), got 5"],
    ),
    "chat-template-does-not-compile": (
        edit_json("tokenizer_config.json", chat_template="{% for m in messages %}{{ m }"),
        ["tokenizer_config.json: the chat template does not compile"],
    ),
    "chat-template-a-number": (
        edit_json("tokenizer_config.json", chat_template=3),
        ["'chat_template' must be a string"],
    ),
    "chat-template-file-does-not-compile": (
        write("chat_template.jinja", "{% if messages %}"),
        ["chat_template.jinja: the chat template does not compile"],
    ),
    # several at once: all of them, in one paragraph
    "two-problems": (
        both(truncate(WEIGHTS, 1000), write("tokenizer.json", "{")),
        ["model.safetensors is truncated", "tokenizer.json is not valid JSON"],
    ),
}

# Damage that stops the model argument from resolving at all: there is no directory to
# check, so `backends check` answers with the error alone (no per-backend reasons).
UNRESOLVED: dict[str, tuple[Damage, list[str]]] = {
    "missing-dir": (missing_dir, ["no-such-model' not found"]),
    "weights-file": (weights_file, ["is a file but not a GGUF file", "config.json"]),
    "no-config": (delete("config.json"), ["has no config.json"]),
    "config-not-json": (
        write("config.json", '{"vocab_size": 512,'),
        ["config.json is not valid JSON"],
    ),
    "config-an-array": (write("config.json", "[1, 2]"), ["config.json must hold a JSON object"]),
    "config-empty": (write("config.json", ""), ["config.json is not valid JSON"]),
}
