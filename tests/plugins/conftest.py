"""Shared setup for the openai-proxy plugin tests: the plugin must be pip-installed (as
``.ci/run`` does), and one real ``llmctl serve`` on stories260K is the upstream."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import STORIES
from tests.helpers.server_process import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "plugins" / "llmctl-openai-proxy"
DISTRIBUTION = "llmctl-openai-proxy"
UPSTREAM_KEY = "upstream-key-7c2e"  # the proxy must send it: exercises proxy_api_key


def require_installed(distribution: str, plugin_dir: Path) -> None:
    """Skip the test unless ``distribution`` is pip-installed here."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            f"{distribution} is not installed in this environment: "
            f"`pip install -e {plugin_dir.relative_to(REPO)}` (as scripts/setup.sh does)"
        )


def require_plugin_installed() -> None:
    require_installed(DISTRIBUTION, PLUGIN_DIR)


def require_stories() -> None:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (it lives in ../shared/models/)")


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus metric from ``url/metrics`` (0 when not exported yet)."""
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.MULTILINE)
    match = pattern.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(match.group(1)) if match else 0.0


def start_upstream() -> ServerProcess:
    """``llmctl serve`` on stories260K with the torch backend, behind an API key."""
    require_stories()
    return start_server(
        [str(STORIES), "--backend", "torch", "--api-key", UPSTREAM_KEY, "--max-batch-size", "8"]
    )


def start_proxy(upstream_url: str, *extra: str) -> ServerProcess:
    """``llmctl serve --backend openai-proxy`` in front of ``upstream_url``; the key comes
    from the environment, as the option's help recommends."""
    require_plugin_installed()
    return start_server(
        ["--backend", "openai-proxy", "--proxy-url", upstream_url, *extra],
        env={"LLMCTL_PROXY_API_KEY": UPSTREAM_KEY},
    )


@pytest.fixture(scope="session")
def upstream() -> Iterator[ServerProcess]:
    server = start_upstream()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def proxy(upstream: ServerProcess) -> Iterator[ServerProcess]:
    server = start_proxy(upstream.url)
    try:
        yield server
    finally:
        server.stop()


# --- the transformers backend plugin (plugins/llmctl-transformers) --------------------

TRANSFORMERS_DISTRIBUTION = "llmctl-transformers"
TRANSFORMERS_PLUGIN_DIR = REPO / "plugins" / "llmctl-transformers"
# Non-Llama checkpoints for the transformers backend: (config class, model class, sizes).
# Both use stories260K's tokenizer (vocabulary 512, BOS 1, EOS 2).
TINY_NON_LLAMA = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_positions=256, n_embd=64, n_layer=2, n_head=4),
    ),
    # Phi: rotary embedding over part of each head, parallel attention and MLP.
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            partial_rotary_factor=0.5,
        ),
    ),
    # GPT-NeoX: its transformers code cannot run continuous batching in transformers 5.24.
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            rotary_pct=0.5,
        ),
    ),
}


def require_transformers_plugin() -> None:
    require_installed(TRANSFORMERS_DISTRIBUTION, TRANSFORMERS_PLUGIN_DIR)


def make_tiny_non_llama(directory: Path, kind: str, seed: int = 0) -> Path:
    """Save a random ``kind`` model (see ``TINY_NON_LLAMA``) with transformers, plus
    stories260K's tokenizer. Weights are drawn wider than transformers' init so that
    logits span several units and greedy choices are not near-ties."""
    import shutil

    import torch
    import transformers

    require_stories()
    config_class, model_class, sizes = TINY_NON_LLAMA[kind]
    config = getattr(transformers, config_class)(
        vocab_size=512, bos_token_id=1, eos_token_id=2, **sizes
    )
    config.architectures = [model_class]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name or "norm" in name:  # layer norms: near 1 (weights), near 0 (biases)
                base = 1.0 if name.endswith("weight") else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def tiny_non_llama(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_non_llama(kind)`` -> a directory with that tiny model, made once per session."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_tiny_non_llama(tmp_path_factory.mktemp(kind), kind)
        return made[kind]

    return get
