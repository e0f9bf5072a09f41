"""The Backend contract and the Engine surface every front end (server, chat, bench, API) uses.

A backend is a class registered by a plugin through the ``llmctl_register_backends``
hook. It says whether it can serve a model here (``check``), maps the unified
options to its own config (``translate``) and builds an ``Engine``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from llmctl.engine.sampling_params import SamplingParams
from llmctl.errors import BackendError
from llmctl.hardware import Hardware
from llmctl.model.config import ModelConfig
from llmctl.model.info import ModelInfo

if TYPE_CHECKING:
    from llmctl.model.tokenizer import Tokenizer  # jinja2 and tokenizers: not for --help

__all__ = [
    "Backend",
    "Engine",
    "EngineCapabilities",
    "EngineStats",
    "GenerationOutput",
    "GenerationRequest",
    "Hardware",
    "ModelInfo",
    "ModelRule",
    "OptionRule",
    "SamplingParams",
    "TokenLogprob",
    "capabilities",
]


@dataclass
class GenerationRequest:
    """One generation: exactly one of ``prompt``, ``prompt_token_ids`` or ``messages``.

    ``messages`` are OpenAI-style chat messages; local engines apply the model's chat
    template to them, with ``tools`` (OpenAI's function tools, as templates take them)
    and ``chat_template_kwargs`` (extra template variables, such as ``enable_thinking``).
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    lora: str | None = None  # the LoRA adapter it runs with (its name); None: the base model
    # Outputs at the first token, then every this many tokens and at the end, each with
    # the tokens since the one before: a consumer that only wants the whole answer
    # (``LLM.generate``) asks for few, and the engine builds no output per token. An
    # engine may always hand out more often.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, not {self.stream_interval}")


@dataclass
class TokenLogprob:
    """The log-probability of one token, with the most likely alternatives.

    A prompt token's (``prompt_logprobs``) also has its ``rank`` in the distribution (1:
    the most likely); the first prompt token has no prefix to be scored by, so its
    ``logprob`` is None."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)  # slots: made once per request per step, a third cheaper
class GenerationOutput:
    """One step of a request's stream: what is new since the previous output.

    ``finish_reason`` is ``"stop"`` (EOS, stop string or stop token), ``"length"``
    (max_tokens reached) or ``"abort"``; it is set only on the last output.
    """

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] | None = None  # the tokenized prompt, on the first output only
    # Prompt tokens whose KV came from the prefix cache, on the first output only
    # (None: the engine does not say).
    cached_tokens: int | None = None
    # One per prompt token when the request asked for prompt logprobs, on the first output only.
    prompt_logprobs: list[TokenLogprob] | None = None

    @classmethod
    def aborted(
        cls,
        request_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        prompt_token_ids: list[int] | None = None,
    ) -> GenerationOutput:
        """The last output of a request stopped before it finished (``finish_reason`` abort)."""
        return cls(
            request_id,
            text="",
            token_ids=[],
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finished=True,
            finish_reason="abort",
            prompt_token_ids=prompt_token_ids,
        )


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_peak: int = 0  # most in use at once (a high-water mark, not a sample)
    block_size: int = 0
    tensor_parallel_size: int = 1  # ranks the model is sharded over
    # Speculative decoding since the start: tokens proposed and accepted, and by position
    # (the j-th entry counts the (j+1)-th proposal of a step)
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_proposed_by_position: tuple[int, ...] = ()
    spec_accepted_by_position: tuple[int, ...] = ()

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used


@runtime_checkable
class Engine(Protocol):
    """What the server, chat, bench and the Python API talk to.

    What an engine offers beyond this (``generate_all``, a health check, ...) it declares
    by deriving from ``EngineCapabilities``; front ends read that through ``capabilities``.
    """

    model_name: str
    # session_len: prompt + generated tokens of one request; 0 when unknown (a proxy
    # whose upstream does not state it, and which then checks lengths itself)
    max_model_len: int

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream outputs. Raises ``InvalidRequest`` before the first output if refused."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...


class EngineCapabilities:
    """What an engine offers beyond the ``Engine`` protocol, declared once as class
    attributes (the way simonw/llm declares ``can_stream`` on a model). An engine derives
    from this and overrides what holds for it; front ends ask ``capabilities(engine)``
    instead of probing with getattr. An engine written to the protocol alone (a
    third-party one) offers nothing beyond it: these defaults."""

    # ``generate_all(requests, on_outputs=None)``: run several requests from a blocking
    # caller and return each one's whole output (the local engines hand a step's outputs
    # over at once, with no event loop between); ``LLM.generate`` and ``bench
    # throughput`` use it.
    can_generate_all: ClassVar[bool] = False
    # ``reset_peak_kv_blocks()`` and ``step_profile(reset)``: a shared-engine step loop
    # whose KV high-water mark and time per step part the benchmarks report.
    has_step_loop: ClassVar[bool] = False
    # Tokens the model knows (the API's bound on prompt token ids); 0: not known here.
    vocab_size: int = 0
    # Whether ``messages`` go through a chat template (else their contents are joined).
    has_chat_template: bool = True
    # The model's tokenizer in this process (/tokenize, echo of token ids, the chat
    # template); None: the engine forwards to one elsewhere (a proxy).
    tokenizer: Tokenizer | None = None
    # Why the engine stopped by itself (a tensor-parallel rank lost, say); None: it did not.
    failure: BaseException | None = None
    # LoRA adapters served beside the model, chosen per request (GenerationRequest.lora):
    # ``lora_names()``, ``load_lora(name, path)`` and ``unload_lora(name)`` (both async).
    serves_lora: ClassVar[bool] = False

    def lora_names(self) -> tuple[str, ...]:
        """The adapters served now (their names, the API's model ids)."""
        return ()

    async def load_lora(self, name: str, path: str) -> None:
        raise NotImplementedError("this engine serves no LoRA adapters (serves_lora)")

    async def unload_lora(self, name: str) -> None:
        raise NotImplementedError("this engine serves no LoRA adapters (serves_lora)")

    def is_alive(self) -> bool:
        """Whether the engine can still serve (its background loop runs); /health says 503
        otherwise. An engine that cannot tell is alive while it answers."""
        return True

    def generate_all(
        self,
        requests: Sequence[GenerationRequest],
        on_outputs: Callable[[list[GenerationOutput]], None] | None = None,
    ) -> list[GenerationOutput]:
        raise NotImplementedError("this engine has no generate_all (can_generate_all)")

    def reset_peak_kv_blocks(self) -> None:
        raise NotImplementedError("this engine has no step loop (has_step_loop)")

    def step_profile(self, reset: bool = False) -> Any:
        raise NotImplementedError("this engine has no step loop (has_step_loop)")


_PROTOCOL_ONLY = EngineCapabilities()


def capabilities(engine: Engine) -> EngineCapabilities:
    """The one place front ends learn what ``engine`` offers beyond the protocol."""
    return engine if isinstance(engine, EngineCapabilities) else _PROTOCOL_ONLY


@dataclass(frozen=True)
class OptionRule:
    """One backend's rule for one option, declared once: ``summary`` goes into the option's
    help text and the generated reference; ``refuses`` says why a value is refused here
    (``None`` when it is accepted). ``refuses(value, options, hardware)`` sees every resolved
    option, for rules that depend on another (the block size on the device)."""

    option: str
    summary: str
    refuses: Callable[[Any, Mapping[str, Any], Hardware], str | None]
    # What an accepted value does here when that is not what it seems (an option with no
    # effect on this device); ``config show --explain`` prints it. ``None``: nothing to say.
    note: Callable[[Any, Mapping[str, Any], Hardware], str | None] | None = None


@dataclass(frozen=True)
class ModelRule:
    """One backend's rule for one model capability (biases, head sizes, ...), declared once
    beside its ``OptionRule``s and checked by ``Backend.check`` from the ``ModelConfig``,
    before anything loads, so ``--backend auto`` falls back and ``backends check`` lists
    the reason. ``summary`` says in a few words what the backend's kernels take;
    ``refuses(config, options, hardware)`` says why this model cannot run here (``None``:
    it can)."""

    feature: str
    summary: str
    refuses: Callable[[ModelConfig, Mapping[str, Any], Hardware], str | None]


def refuse_cuda_without_gpu(
    value: Any, options: Mapping[str, Any], hardware: Hardware
) -> str | None:
    """The ``device`` rule every local backend shares."""
    if value == "cuda" and not hardware.cuda_available:
        return "device 'cuda' asked for, but no CUDA GPU is available here"
    return None


DEVICE_RULE = OptionRule("device", "`cuda` needs a CUDA GPU", refuse_cuda_without_gpu)

FP8_MIN_COMPUTE_CAPABILITY = (8, 9)  # Ada and Hopper have fp8 (e4m3) conversions


def fp8_problem(options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """Why fp8 (e4m3) cannot run with these options here (``None``: it can): it needs a
    CUDA GPU of compute capability >= 8.9. Shared by every backend with fp8 kernels."""
    need = ".".join(map(str, FP8_MIN_COMPUTE_CAPABILITY))
    if hardware.device_for(options.get("device", "auto")) != "cuda":
        return f"fp8 (e4m3) needs a CUDA GPU of compute capability >= {need}; on the CPU use int8"
    capability = hardware.compute_capability or (0, 0)
    if capability < FP8_MIN_COMPUTE_CAPABILITY:
        return (
            f"fp8 (e4m3) needs compute capability >= {need}, this GPU has "
            f"{capability[0]}.{capability[1]}: use int8"
        )
    return None


def one_device_rules(backend: str) -> tuple[OptionRule, ...]:
    """The rules of a backend that runs a model on one device of one machine: it refuses
    the tensor-parallel options (the torch backend shards models)."""

    def rule(option: str, single: int) -> OptionRule:
        def refuses(value: Any, options: Mapping[str, Any], hardware: Hardware) -> str | None:
            if value == single:
                return None
            return f"{option} must be {single}: {backend} runs a model on one device of one machine"

        return OptionRule(option, f"{single} only (one device)", refuses)

    return (rule("tensor_parallel_size", 1), rule("nnodes", 1), rule("node_rank", 0))


def cuda_graphs_note(value: Any, options: Mapping[str, Any], hardware: Hardware) -> str | None:
    """CUDA graphs save kernel launches on a GPU; on the CPU there is nothing to capture."""
    if value and hardware.device_for(options.get("device", "auto")) != "cuda":
        return "ignored on the CPU (CUDA graphs need a CUDA device)"
    return None


# The ``cpu_threads`` rule of backends that compute on the CPU through torch's own threads.
TORCH_THREADS_RULE = OptionRule(
    "cpu_threads",
    "sets torch's thread count (torch.set_num_threads), for the whole process",
    lambda value, options, hardware: None,
)

# The ``cuda_graphs`` rule both local backends share (llmctl.engine.runner.DecodeGraphs).
CUDA_GRAPHS_RULE = OptionRule(
    "cuda_graphs",
    "on CUDA, decode steps replay graphs captured at start for batch sizes 1, 2, 4, 8, 16, "
    "then every 16 up to max_batch_size (with speculation, verification steps of up to "
    "num_speculative_tokens + 1 tokens per sequence too; torch: steps with LoRA adapters "
    "too, captured at the first one); ignored on the CPU",
    lambda value, options, hardware: None,
    note=cuda_graphs_note,
)


def _speculative_method_problem(value: Any, options: Mapping[str, Any], hw: Hardware) -> str | None:
    if value != "draft":
        return None
    if not options.get("speculative_model"):
        return (
            "speculative_method=draft needs speculative_model: a small model that shares "
            "this model's tokenizer (or use speculative_method=ngram)"
        )
    if options.get("tensor_parallel_size", 1) > 1:
        return (
            "speculative_method=draft runs the draft model unsharded, so not with "
            "tensor_parallel_size > 1; use speculative_method=ngram"
        )
    return None


def _ngram_min_problem(value: Any, options: Mapping[str, Any], hw: Hardware) -> str | None:
    if value > options.get("ngram_max", value):
        return f"ngram_min ({value}) must not be larger than ngram_max ({options['ngram_max']})"
    return None


def _speculative_method_note(value: Any, options: Mapping[str, Any], hw: Hardware) -> str | None:
    """What speculation does here, as ``config show --explain`` prints it."""
    tokens = options.get("num_speculative_tokens", 4)
    if value == "ngram":
        note = (
            f"prompt lookup proposes up to {tokens} tokens per step (suffixes of "
            f"{options.get('ngram_min', 1)}-{options.get('ngram_max', 4)} tokens), verified "
            "in one step; greedy output unchanged"
        )
    elif value == "draft":
        note = (
            f"the draft model {options.get('speculative_model')} proposes up to {tokens} "
            "tokens per step (its greedy tokens, over its own paged cache), verified in one "
            "step; output unchanged"
        )
    else:
        return None
    if hw.device_for(options.get("device", "auto")) == "cuda":
        note += "; on CUDA steps no longer overlap"
        if options.get("cuda_graphs", True):
            note += f", and verification steps (up to {tokens + 1} tokens) replay CUDA graphs"
    return note


# The speculative-decoding rules both local backends share (llmctl.engine.speculative).
SPECULATIVE_RULES = (
    OptionRule(
        "speculative_method",
        "`none`, `ngram` or `draft` (with speculative_model, not with tensor parallelism); "
        "verified in one step over the paged cache",
        _speculative_method_problem,
        note=_speculative_method_note,
    ),
    OptionRule("ngram_min", "at most ngram_max", _ngram_min_problem),
    OptionRule(
        "speculative_model",
        "only with speculative_method=draft",
        lambda value, options, hardware: (
            f"speculative_model is the draft model of speculative_method=draft, not "
            f"{options.get('speculative_method', 'none')}: set both, or neither"
            if value and options.get("speculative_method") != "draft"
            else None
        ),
    ),
)


def no_speculation_rule(backend: str) -> OptionRule:
    """The rule of a backend that never speculates."""
    return OptionRule(
        "speculative_method",
        "`none` only",
        lambda value, options, hardware: (
            None
            if value == "none"
            else f"{backend} has no speculative decoding; use --backend torch or turbo"
        ),
    )


class Backend:
    """Base class for backends. Subclasses set the class attributes and override methods.

    Higher ``priority`` is tried first by ``--backend auto``. ``option_defaults`` are the
    backend's own defaults (resolution level 5, below profiles, above the schema).
    ``rules`` are its rules for option values (see ``OptionRule``), ``model_rules`` those
    for what a model needs from its kernels (see ``ModelRule``).
    ``supported_architectures`` of ``None`` means any.
    Backend methods must not import heavy packages until they are called.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    description: ClassVar[str] = ""
    option_defaults: ClassVar[Mapping[str, Any]] = {}
    rules: ClassVar[tuple[OptionRule, ...]] = ()
    model_rules: ClassVar[tuple[ModelRule, ...]] = ()
    supported_architectures: ClassVar[frozenset[str] | None] = None
    # False for backends that forward to a remote server: the model argument is then a
    # name for the remote side, not a local directory.
    loads_local_model: ClassVar[bool] = True
    # True for a backend that is there for models the others cannot run (transformers):
    # ``auto`` never moves to it because of an option value another backend refuses.
    last_resort: ClassVar[bool] = False

    def check_hardware(self, hardware: Hardware) -> list[str]:
        """Reasons this backend cannot run on this machine at all (empty: it can)."""
        return []

    def option_errors(self, options: Mapping[str, Any], hardware: Hardware) -> dict[str, str]:
        """Options whose values this backend refuses, each mapped to the rule it breaks."""
        errors = {}
        for rule in self.rules:
            value = options.get(rule.option)
            if value is not None and (problem := rule.refuses(value, options, hardware)):
                errors[rule.option] = problem
        return errors

    def model_errors(
        self, config: ModelConfig, options: Mapping[str, Any], hardware: Hardware
    ) -> list[str]:
        """Why this backend's kernels cannot run a model with ``config`` (``ModelRule``s)."""
        return [
            problem
            for rule in self.model_rules
            if (problem := rule.refuses(config, options, hardware))
        ]

    def option_notes(self, options: Mapping[str, Any], hardware: Hardware) -> dict[str, str]:
        """Options whose values have an effect here other than it seems (see ``OptionRule.note``)."""
        notes = {}
        for rule in self.rules:
            value = options.get(rule.option)
            if rule.note is not None and value is not None:
                if note := rule.note(value, options, hardware):
                    notes[rule.option] = note
        return notes

    def check(self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware) -> list[str]:
        """Every reason this backend cannot serve ``model`` with ``options`` here."""
        reasons = list(self.check_hardware(hardware))
        if self.loads_local_model:  # a broken model directory (llmctl.model.check)
            reasons += model.problems
        supported = self.supported_architectures
        if supported is not None and model.architecture not in supported:
            reasons.append(
                f"architecture {model.architecture} is not supported "
                f"(supported: {', '.join(sorted(supported))})"
            )
        elif self.loads_local_model and model.model_config is not None:
            reasons += self.model_errors(model.model_config, options, hardware)
        for option, rule in self.option_errors(options, hardware).items():
            reasons.append(f"{option}={options[option]!r} refused: {rule}")
        return reasons

    def prepare(self, hardware: Hardware) -> str | None:
        """Build or fetch what the backend needs ahead of first use (``llmctl backends
        build``); return a one-line summary, or None when there is nothing to prepare."""
        return None

    def run_worker_node(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> None:
        """Run this machine's ranks of an engine sharded over several machines
        (``node_rank`` > 0) until the head node stops them (``llmctl serve`` there)."""
        raise BackendError(f"backend {self.name!r} does not run across machines")

    def translate(self, options: Mapping[str, Any]) -> Any:
        """Map unified option names to this backend's own config: the one place it happens."""
        return dict(options)

    def create_engine(
        self, model: ModelInfo, options: Mapping[str, Any], hardware: Hardware
    ) -> Engine:
        raise NotImplementedError(f"backend {self.name!r} cannot create an engine")
