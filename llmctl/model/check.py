"""Can llmctl's engines load this model directory? Checked once, before any backend builds
an engine, so a broken directory gets one clear message on every backend.

It reads only small things: config.json (every value checked for type and range), the
safetensors headers (not the weights: names, shapes and dtypes are compared with what
config.json implies, and a truncated or damaged file is named with its size) and the
tokenizer files (parsed as the engine parses them). No torch: ``backends check`` and
backend selection run it cheaply.

Who uses it: ``ModelInfo.problems`` (so ``Backend.check`` lists the problems as reasons,
and ``selection`` refuses a broken directory before trying any backend), and ``llmctl
models DIR``. A plugin that loads Hugging Face directories itself can call
``check_model_dir(path)`` (or ``ModelInfo.ensure_loadable()``, which raises a ModelError
listing the problems).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.errors import LlmctlError, ModelError
from llmctl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from llmctl.model.files import read_architecture, read_json_object
from llmctl.model.tokenizer import Tokenizer
from llmctl.model.weights import (
    INDEX_FILE,
    TensorEntry,
    read_header,
    read_index,
    safetensors_files,
)

# Float dtypes the loader converts to the engine's dtype; anything else (int8, fp8 with
# scales, ...) is a quantized checkpoint the engines do not run.
LOADABLE_DTYPES = ("F32", "BF16", "F16", "F64")
# Tensors some checkpoints carry that the engines recompute (RoPE frequencies).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SHOWN_NAMES = 3
LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class ModelReport:
    """What llmctl reads from a model directory, and everything wrong with it."""

    path: Path
    chat_template: str | None = None  # the override the engine will use, if any
    architecture: str | None = None
    # None when config.json has a problem, or names an architecture other than the
    # Llama family llmctl's engines run (a plugin may still serve it).
    config: ModelConfig | None = None
    weight_files: list[Path] = field(default_factory=list)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    tokenizer: Tokenizer | None = None
    problems: list[str] = field(default_factory=list)

    def add(self, problem: str) -> None:
        if problem not in self.problems:  # two readers of one file may report it twice
            self.problems.append(problem)

    def error_message(self) -> str:
        """The problems as one paragraph for an ``Error:`` line."""
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{self.path} has {len(self.problems)} problems:\n" + "\n".join(
            f"  - {problem}" for problem in self.problems
        )


def check_model_dir(path: str | Path, chat_template: str | None = None) -> ModelReport:
    """Everything wrong with the model directory ``path`` (config.json must exist).

    ``chat_template`` (the option) replaces the model's own template: then that one is
    checked, and a broken template of the model's does not count."""
    from llmctl.model.demo import ensure_demo_materialized

    ensure_demo_materialized(path)
    report = ModelReport(Path(path), chat_template=chat_template)
    for check in (_check_config, _check_weights, _check_tokenizer):
        try:
            check(report)
        except OSError as exc:  # unreadable, vanished, a directory where a file should be
            report.add(f"{exc.filename or report.path} cannot be read: {exc.strerror}")
    return report


def expected_tensors(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a Hugging Face checkpoint with this config holds, as transformers saves
    them: name → (shape, the config keys the shape comes from)."""
    c = config
    hidden, vocab, mlp = c.hidden_size, c.vocab_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, v, i = "hidden_size", "vocab_size", "intermediate_size"
    qs, kvs = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
    tensors = {
        "model.embed_tokens.weight": ((vocab, hidden), f"{v} x {h}"),
        "model.norm.weight": ((hidden,), h),
    }
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = ((vocab, hidden), f"{v} x {h}")
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        layer_tensors = {
            "input_layernorm.weight": ((hidden,), h),
            "post_attention_layernorm.weight": ((hidden,), h),
            "self_attn.q_proj.weight": ((q, hidden), f"{qs} x {h}"),
            "self_attn.k_proj.weight": ((kv, hidden), f"{kvs} x {h}"),
            "self_attn.v_proj.weight": ((kv, hidden), f"{kvs} x {h}"),
            "self_attn.o_proj.weight": ((hidden, q), f"{h} x {qs}"),
            "mlp.gate_proj.weight": ((mlp, hidden), f"{i} x {h}"),
            "mlp.up_proj.weight": ((mlp, hidden), f"{i} x {h}"),
            "mlp.down_proj.weight": ((hidden, mlp), f"{h} x {i}"),
        }
        if c.qkv_bias:
            layer_tensors["self_attn.q_proj.bias"] = ((q,), qs)
            layer_tensors["self_attn.k_proj.bias"] = ((kv,), kvs)
            layer_tensors["self_attn.v_proj.bias"] = ((kv,), kvs)
        if c.o_proj_bias:
            layer_tensors["self_attn.o_proj.bias"] = ((hidden,), h)
        if c.qk_norm:
            layer_tensors["self_attn.q_norm.weight"] = ((c.head_dim,), "head_dim")
            layer_tensors["self_attn.k_norm.weight"] = ((c.head_dim,), "head_dim")
        if c.mlp_bias:
            layer_tensors["mlp.gate_proj.bias"] = ((mlp,), i)
            layer_tensors["mlp.up_proj.bias"] = ((mlp,), i)
            layer_tensors["mlp.down_proj.bias"] = ((hidden,), h)
        tensors.update({p + name: spec for name, spec in layer_tensors.items()})
    return tensors


def _check_config(report: ModelReport) -> None:
    config_file = report.path / "config.json"
    try:
        raw = read_json_object(config_file, required=True)
        report.architecture = read_architecture(raw, str(config_file))
    except ModelError as exc:
        report.add(str(exc))
        return
    if report.architecture not in SUPPORTED_ARCHITECTURES:
        return  # not for llmctl's engines; each backend's check names the architecture
    try:
        report.config = ModelConfig.from_dir(report.path)
    except ModelError as exc:
        report.add(str(exc))


def _check_weights(report: ModelReport) -> None:
    try:
        files = safetensors_files(report.path)
        weight_map = read_index(report.path)
    except ModelError as exc:
        report.add(str(exc))
        return
    report.weight_files = files
    owners: dict[str, Path] = {}
    readable = []
    for file in files:
        try:
            header = read_header(file)
        except ModelError as exc:
            report.add(str(exc))
            continue
        readable.append(file)
        twice = sorted(name for name in header if name in owners)
        if twice:
            report.add(
                f"{file} repeats {_few(twice)} from {owners[twice[0]].name}: the shards overlap "
                "(files of two different downloads?); download the checkpoint again"
            )
        owners.update(dict.fromkeys(header, file))
        report.tensors.update(header)
    if weight_map is not None:
        misplaced = [
            f"{name} (in {shard})"
            for name, shard in weight_map.items()
            if report.path / shard in readable and owners.get(name) != report.path / shard
        ]
        if misplaced:
            report.add(
                f"{report.path / INDEX_FILE} places {len(misplaced)} tensor(s) in shards that "
                f"do not hold them: {_few(misplaced)}; the index and the shards come from "
                "different downloads: download the checkpoint again"
            )
    if report.config is not None and len(readable) == len(files):
        _compare_with_config(report, owners)


def _compare_with_config(report: ModelReport, owners: dict[str, Path]) -> None:
    """Names, shapes and dtypes of the weights against what config.json implies."""
    config, tensors = report.config, report.tensors
    expected = expected_tensors(config)
    config_file = report.path / "config.json"
    unloadable = sorted(n for n, t in tensors.items() if t.dtype not in LOADABLE_DTYPES)
    if unloadable:
        dtypes = sorted({tensors[n].dtype for n in unloadable})
        report.add(
            f"{report.path}: {len(unloadable)} tensor(s) are stored as {', '.join(dtypes)} "
            f"({_few(unloadable)}); llmctl's engines load float weights "
            f"({', '.join(LOADABLE_DTYPES)}): quantized or integer checkpoints are not "
            "supported, use the model's float weights"
        )
    missing = sorted(set(expected) - set(tensors))
    if config.tie_word_embeddings:  # some tied checkpoints also store the output matrix
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    extra = sorted(
        name for name in set(tensors) - set(expected) if not name.endswith(IGNORED_SUFFIXES)
    )
    model = f"a {config.architecture} with this config.json ({config.num_layers} layers)"
    if missing:
        report.add(
            f"{report.path}: the weights lack {len(missing)} tensor(s) {model} needs: "
            f"{_few(missing)}{_layer_hint(tensors, config)}; download the checkpoint again, "
            "or fix config.json"
        )
    if extra:
        report.add(
            f"{report.path}: the weights hold {len(extra)} tensor(s) {model} has no place "
            f"for: {_few(extra)}{_layer_hint(tensors, config)}; config.json and the weights "
            "do not belong together"
        )
    wrong = [
        f"{name} is {actual} in {owners[name].name}, but config.json says {shape} ({keys})"
        for name, actual, shape, keys in wrong_shapes(expected, tensors)
    ]
    if wrong:
        report.add(
            f"{report.path}: the weights do not match {config_file}: {_few(wrong, '; ')}; "
            "config.json and the weights belong to different models, or one was edited"
        )


def wrong_shapes(
    expected: dict[str, tuple[tuple[int, ...], str]], tensors: dict[str, Any]
) -> list[tuple[str, list[int], list[int], str]]:
    """``(name, shape, expected shape, the config keys behind it)`` for each tensor of
    ``tensors`` (anything with a ``shape``) that ``expected`` sizes otherwise."""
    return [
        (name, list(tensors[name].shape), list(shape), keys)
        for name, (shape, keys) in expected.items()
        if name in tensors and tuple(tensors[name].shape) != tuple(shape)
    ]


def _check_tokenizer(report: ModelReport) -> None:
    try:
        report.tokenizer = Tokenizer.from_dir(report.path, chat_template=report.chat_template)
    except LlmctlError as exc:
        report.add(str(exc))
        return
    config = report.config
    highest = report.tokenizer.highest_token_id
    if config is not None and highest >= config.vocab_size:
        report.add(
            f"{report.path / 'tokenizer.json'} has token ids up to {highest}, but "
            f"{report.path / 'config.json'} says vocab_size {config.vocab_size}: the "
            "tokenizer belongs to another model"
        )


def _few(names: list[str], separator: str = ", ") -> str:
    shown = separator.join(names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def _layer_hint(tensors: dict[str, TensorEntry], config: ModelConfig) -> str:
    """When the weights hold another number of layers, num_hidden_layers is the culprit."""
    layers = {int(m.group(1)) for name in tensors if (m := LAYER.match(name))}
    count = max(layers) + 1 if layers else 0
    if count == config.num_layers:
        return ""
    return f" (the weights have {count} layers, config.json says num_hidden_layers {config.num_layers})"
