"""The CLI as a user meets it: fast help, clear one-paragraph errors, --explain sources."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.cli import run_llmctl


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["chat", "--help"], ["config", "show", "--help"]]
)
def test_help_imports_no_torch(argv):
    code = textwrap.dedent(
        f"""
        import sys
        sys.argv = ["llmctl", *{argv!r}]
        from llmctl.cli.main import run
        try:
            run()
        except SystemExit:
            pass
        heavy = sorted(m for m in ("torch", "transformers", "fastapi", "triton") if m in sys.modules)
        print("HEAVY", heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_explain_names_every_source(tmp_path):
    (tmp_path / "llmctl.toml").write_text(
        "[profiles.p]\nsession_len = 512\nmax_batch_size = 3\n[profiles.p.torch]\nmax_batch_size = 7\n"
    )
    result = run_llmctl(
        "config", "show", "--profile", "p", "--backend", "torch", "--explain",
        "--cache-block-seq-len", "32",
        cwd=tmp_path,
        env={"LLMCTL_SEED": "9"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│" in line}
    assert "flag" in rows["cache_block_seq_len"] and "32" in rows["cache_block_seq_len"]
    assert "env (LLMCTL_SEED)" in rows["seed"]
    assert "profile section" in rows["max_batch_size"] and " 7 " in rows["max_batch_size"]
    assert "profile (" in rows["session_len"] and "512" in rows["session_len"]
    assert "schema default" in rows["port"]


@pytest.mark.parametrize(
    ("args", "code", "fragments"),
    [
        (["config", "show", "--cache-block-seq-le", "3"], 2, ["--cache-block-seq-len"]),
        (["config", "show", "--cache-block-seq-len", "abc"], 2, ["valid integer"]),
        (["config", "show", "--cache-block-seq-len", "0"], 1, ["too small", "cache_block_seq_len"]),
        (["config", "show", "--profile", "nope"], 1, ["profile 'nope' not found"]),
        (["config", "show", "--backend", "torhc"], 1, ["unknown backend", "torch"]),
        (["config", "show", "--dtype", "fp8"], 1, ["not one of"]),
        (["backends", "check", "no/such-model"], 1, ["not in the local Hugging Face cache"]),
        (["backends", "check", "demo", "--cache-block-seq-len", "48", "--backend", "torch"], 1,
         ["cache_block_seq_len=48", "power of two"]),
    ],
)  # fmt: skip
def test_bad_input_is_one_paragraph_and_nonzero(args, code, fragments, tmp_path):
    result = run_llmctl(*args, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    assert "Traceback" not in output
    flat = " ".join(output.split())
    for fragment in fragments:
        assert fragment in flat, output


def test_malformed_profile_file_names_the_line(tmp_path):
    (tmp_path / "llmctl.toml").write_text("[profiles.a]\nseed = = 3\n")
    result = run_llmctl("profiles", "validate", cwd=tmp_path)
    assert result.returncode == 1
    flat = " ".join((result.stdout + result.stderr).split())
    assert "llmctl.toml" in flat and "line 2" in flat and "Traceback" not in flat


def test_profiles_list_show_validate(tmp_path):
    (tmp_path / "llmctl.toml").write_text(
        '[profiles.chat-small]\nmodel = "demo"\nsession_len = 256\n[profiles.chat-small.turbo]\n'
        "cache_block_seq_len = 128\n"
    )
    listing = run_llmctl("profiles", "list", cwd=tmp_path)
    assert listing.returncode == 0 and "chat-small" in listing.stdout
    shown = run_llmctl("profiles", "show", "chat-small", cwd=tmp_path)
    assert "profiles.chat-small.turbo" in shown.stdout and "128" in shown.stdout
    valid = run_llmctl("profiles", "validate", str(tmp_path / "llmctl.toml"))
    assert valid.returncode == 0 and "OK" in valid.stdout


def test_backends_check_explains_each_backend(tmp_path):
    from llmctl.model.info import resolve_model
    from tests.helpers.lora_adapters import write_small_adapter

    adapter = write_small_adapter(tmp_path / "adapter", resolve_model("demo").path)
    result = run_llmctl("backends", "check", "demo", "--lora", f"a={adapter}", cwd=tmp_path)
    out = " ".join(result.stdout.split())
    # turbo and torch serve adapters on the CPU; transformers says why it does not.
    assert "✓ turbo can serve" in out and "✓ torch can serve" in out
    assert "✗ transformers cannot serve" in out and "does not serve LoRA adapters" in out
    assert "auto would pick turbo" in out


def test_models_lists_the_hf_cache_and_resolves_hub_ids(tmp_path, stories_dir):
    import shutil

    snapshot = tmp_path / "hub" / "models--tiny--stories" / "snapshots" / "abc123"
    shutil.copytree(stories_dir, snapshot)
    (tmp_path / "hub" / "models--tiny--stories" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--stories" / "refs" / "main").write_text("abc123")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    listing = run_llmctl("models", env=env)
    flat = " ".join(listing.stdout.split())
    assert "tiny/stories" in flat and "LlamaForCausalLM" in flat
    check = run_llmctl("backends", "check", "tiny/stories", "--backend", "torch", env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "abc123" in " ".join(check.stdout.split()).replace(" ", "")


def test_config_show_masks_secrets(tmp_path):
    result = run_llmctl("config", "show", "--backend", "torch", "--api-keys", "sk-hidden")
    assert result.returncode == 0, result.stderr
    assert "sk-hidden" not in result.stdout
    assert any("api_keys" in line and "****" in line for line in result.stdout.splitlines())


def test_explain_says_cuda_graphs_are_ignored_on_the_cpu():
    result = run_llmctl("config", "show", "--backend", "torch", "--device", "cpu", "--explain")
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if "│" in line}
    assert "torch: ignored on the CPU" in rows["cuda_graphs"]
    off = run_llmctl("config", "show", "--backend", "torch", "--no-cuda-graphs", "--explain")
    assert "ignored" not in off.stdout and "flag (--cuda-graphs)" in off.stdout
