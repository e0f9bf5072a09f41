"""``llmctl models FILE.gguf`` and ``llmctl backends check FILE.gguf`` as a user runs them."""

from __future__ import annotations

from tests.helpers.cli import run_llmctl


def flat(text: str) -> str:
    return " ".join(text.split())


def test_models_shows_what_llmctl_reads_from_a_gguf(tiny_gguf):
    _, path = tiny_gguf("qwen2", "Q4_1")
    result = run_llmctl("models", str(path))
    out = flat(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Qwen2ForCausalLM (qwen2)" in out
    assert "2 layers, hidden 64, 4 heads (2 KV heads) of 16, MLP 96, vocab 512" in out
    # Q4_1 for the matrices whose rows split into 32-value blocks, F32 for the rest.
    assert "GGUF file" in out and "Q4_1" in out and "F32" in out
    assert "GGUF metadata (llama SentencePiece BPE, pre-tokenizer default), 512 tokens" in out
    assert "from the GGUF metadata (tokenizer.chat_template)" in out
    assert "No problem found" in out


def test_backends_check_lists_every_local_backend_for_a_gguf(tiny_gguf):
    _, path = tiny_gguf("llama-mqa", "Q8_0")
    result = run_llmctl("backends", "check", str(path.parent))  # the directory holding it
    out = flat(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"at {path}" in out
    for backend in ("turbo", "torch", "transformers"):
        assert f"✓ {backend} can serve" in out, out
