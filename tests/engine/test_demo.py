"""The built-in demo model: generated deterministically, atomically, with a byte tokenizer."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from llmctl.model import demo
from llmctl.model.config import ModelConfig
from llmctl.model.demo import (
    DEMO_CONFIG,
    demo_model_dir,
    ensure_demo_materialized,
    materialize_demo,
)
from llmctl.model.weights import load_weights

FILES = [
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return materialize_demo(tmp_path_factory.mktemp("cache") / "demo")


def test_two_materializations_are_byte_identical(demo_dir, tmp_path):
    again = materialize_demo(tmp_path / "demo")
    assert sorted(p.name for p in demo_dir.iterdir()) == FILES
    for name in FILES:
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_it_loads_as_the_config_says(demo_dir):
    config = ModelConfig.from_dir(demo_dir)
    assert config.vocab_size == DEMO_CONFIG["vocab_size"]
    weights = load_weights(demo_dir)
    assert weights["model.embed_tokens.weight"].shape == (
        DEMO_CONFIG["vocab_size"],
        DEMO_CONFIG["hidden_size"],
    )
    # embeddings, final norm and lm_head, plus 9 tensors per layer
    assert len(weights) == 3 + 9 * DEMO_CONFIG["num_hidden_layers"]
    # Random, not zeros: the demo must produce varied logits.
    assert weights["model.layers.0.self_attn.q_proj.weight"].std() > 0.01


def test_it_says_the_weights_are_random_and_has_no_chat_template(demo_dir):
    assert "RANDOM" in (demo_dir / "README.md").read_text()
    tokenizer_config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert "chat_template" not in tokenizer_config
    assert not list(demo_dir.glob("*.jinja"))


def test_tokenizer_specials_match_the_config(demo_dir):
    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == DEMO_CONFIG["vocab_size"]
    assert tokenizer.token_to_id("<s>") == DEMO_CONFIG["bos_token_id"]
    assert tokenizer.token_to_id("</s>") == DEMO_CONFIG["eos_token_id"]
    assert tokenizer.encode("A").ids == [DEMO_CONFIG["bos_token_id"], 3 + ord("A")]


@pytest.fixture(scope="module")
def tokenizer(demo_dir) -> Tokenizer:
    return Tokenizer.from_file(str(demo_dir / "tokenizer.json"))


@settings(max_examples=100, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_utf8(tokenizer, text):
    assume(not any(special in text for special in ("<unk>", "<s>", "</s>")))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == [3 + byte for byte in text.encode("utf-8")]
    assert tokenizer.decode(ids) == text


def test_transformers_reads_the_tokenizer(demo_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    text = "héllo, 世界 🎉"
    ids = tokenizer(text).input_ids
    assert ids[0] == DEMO_CONFIG["bos_token_id"] and len(ids) == 1 + len(text.encode())
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.chat_template is None


def test_racing_writers_both_get_a_complete_model(tmp_path, monkeypatch):
    """Two writers finish their staging copies together; one rename wins, the other
    discards its copy and returns the winner's directory."""
    barrier = threading.Barrier(2, timeout=60)
    write_demo = demo._write_demo

    def write_then_wait(directory: Path) -> None:
        write_demo(directory)
        barrier.wait()

    monkeypatch.setattr(demo, "_write_demo", write_then_wait)
    target = tmp_path / "race" / "demo"
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(materialize_demo, [target, target]))
    assert results == [target, target]
    assert sorted(p.name for p in target.iterdir()) == FILES
    assert [p.name for p in target.parent.iterdir()] == ["demo"]  # no staging left over


def test_loaders_materialize_the_demo_dir_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    assert not demo_model_dir().exists()
    ensure_demo_materialized(tmp_path / "elsewhere")  # not the demo dir: nothing happens
    assert not (tmp_path / "elsewhere").exists()
    config = ModelConfig.from_dir(demo_model_dir())
    assert config.vocab_size == DEMO_CONFIG["vocab_size"]
    assert sorted(p.name for p in demo_model_dir().iterdir()) == FILES
