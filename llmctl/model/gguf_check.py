"""Can llmctl's engines load this GGUF file? The GGUF side of ``llmctl.model.check``:
the same ``ModelReport``, from the file's header, metadata and tensor table (no tensor
data is read, no torch).

Checked: the magic bytes, the version and that the tensors fit in the file (the reader,
``llmctl.model.gguf``); the architecture and its config values (``ModelConfig``); tensor
types llmctl can dequantize; tensor names and shapes against what the metadata implies;
the tokenizer and chat template built from the metadata.
"""

from __future__ import annotations

from pathlib import Path

from llmctl.errors import LlmctlError, ModelError
from llmctl.model.check import ModelReport, expected_tensors, wrong_shapes
from llmctl.model.config import ModelConfig
from llmctl.model.gguf import GGUFModel, gguf_file, open_gguf, unreadable_message
from llmctl.model.tokenizer import Tokenizer

# Which GGUF metadata keys a config value comes from, to name them in a shape mismatch.
METADATA_KEYS = {
    "hidden_size": "embedding_length",
    "vocab_size": "vocab_size",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
}
SHOWN = 3


def check_gguf(path: str | Path, chat_template: str | None = None) -> ModelReport:
    """Everything wrong with the GGUF file ``path`` (or the one in directory ``path``)."""
    try:
        file = gguf_file(path) or Path(path)
    except ModelError as exc:
        report = ModelReport(Path(path), chat_template=chat_template)
        report.add(str(exc))
        return report
    report = ModelReport(file, chat_template=chat_template, weight_files=[file])
    try:
        model = open_gguf(file)
    except ModelError as exc:
        report.add(str(exc))
        return report
    except OSError as exc:
        report.add(f"{file} cannot be read: {exc.strerror}")
        return report
    report.tensors = dict(model.tensors)
    try:
        report.architecture = model.hf_config["architectures"][0]
        report.config = ModelConfig.from_dict(model.hf_config, source=f"{file} (GGUF metadata)")
    except ModelError as exc:
        report.add(str(exc))
    unreadable = model.unreadable_tensors()
    if unreadable:
        report.add(unreadable_message(file, unreadable))
    if report.config is not None:
        _compare_with_metadata(report, model)
    try:
        report.tokenizer = Tokenizer.from_gguf(model.path, chat_template)
    except LlmctlError as exc:
        report.add(str(exc))
    else:
        highest = report.tokenizer.highest_token_id
        if report.config is not None and highest >= report.config.vocab_size:
            report.add(
                f"{file}: its vocabulary (tokenizer.ggml.tokens) has token ids up to {highest}, "
                f"but the model has {report.config.vocab_size} embeddings: the file is damaged; "
                "convert it again"
            )
    return report


def _compare_with_metadata(report: ModelReport, model: GGUFModel) -> None:
    """Tensor names and shapes against what the metadata implies."""
    config = report.config
    expected = expected_tensors(config)
    tensors = report.tensors
    where = f"{report.path}"
    missing = sorted(set(expected) - set(tensors), key=_layer_order)
    extra = sorted(set(tensors) - set(expected), key=_layer_order)
    wrong = [
        f"{tensors[name].gguf_name} is {actual}, but the metadata says {shape} "
        f"({_metadata_keys(model, keys)})"
        for name, actual, shape, keys in wrong_shapes(expected, tensors)
    ]
    if missing:
        names = [_gguf_name(model, name) for name in missing]
        report.add(
            f"{where}: it lacks {len(missing)} tensor(s) a {config.architecture} with its "
            f"metadata ({config.num_layers} layers, {model.arch}.block_count) needs: "
            f"{_few(names)}; the file is incomplete or its metadata is wrong: convert it again"
        )
    if extra:
        report.add(
            f"{where}: it holds {len(extra)} tensor(s) llmctl's {config.architecture} has no "
            f"place for: {_few([tensors[n].gguf_name for n in extra])}; the metadata and the "
            "tensors do not belong together (or the model is of another kind): convert it again"
        )
    if wrong:
        report.add(
            f"{where}: the tensors do not match the metadata: {_few(wrong, '; ')}; the "
            "metadata was edited or the file is damaged: convert it again"
        )


def _metadata_keys(model: GGUFModel, keys: str) -> str:
    """``hidden_size x vocab_size`` as the GGUF keys those values come from."""
    for config_key, gguf_key in METADATA_KEYS.items():
        keys = keys.replace(config_key, f"{model.arch}.{gguf_key}")
    return keys


def _gguf_name(model: GGUFModel, hf_name: str) -> str:
    from llmctl.model.gguf import GLOBAL_TENSORS, LAYER_TENSORS

    for gguf, hf in GLOBAL_TENSORS.items():
        if hf == hf_name:
            return gguf
    parts = hf_name.split(".")  # model.layers.N.<module path>.weight
    module = ".".join(parts[3:-1])
    for gguf, hf in LAYER_TENSORS.items():
        if hf == module:
            return f"blk.{parts[2]}.{gguf}.{parts[-1]}"
    return hf_name


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1, name)


def _few(names: list[str], separator: str = ", ") -> str:
    shown = separator.join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
