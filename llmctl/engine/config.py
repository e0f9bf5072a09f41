"""The engine's configuration: one frozen ``EngineConfig``, built once from resolved options.

A local backend's ``translate(options)`` builds it (``EngineConfig.from_options``: the one
place the user's option names map to the engine's), and the same object goes to the
runner and to the engine (``engine.assemble.build_engine``). One name per concept inside:
``block_size`` is the user's ``cache_block_seq_len``, ``max_model_len`` their
``session_len``, ``max_num_seqs`` their ``max_batch_size``. What only one backend has
(the torch backend's tensor-parallel layout) is its small typed
``extra``. Like nano-vllm's ``config.py``, with llmctl's error text: a value the options
schema let through that the engine cannot use names the user's option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from llmctl.errors import OptionError
from llmctl.kv_budget import KVBudget, parse_kv_budget

Extra = TypeVar("Extra")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``llmctl.engine.speculative``): ``method`` ``none``,
    ``ngram`` or ``draft``; up to ``num_tokens`` proposed per step, by n-gram lookup
    (suffixes of ``ngram_min`` to ``ngram_max`` tokens) or by the draft model ``model``
    (a model argument, as the CLI takes it: ``llmctl.engine.draft``)."""

    method: str = "none"
    num_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    model: str | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (``llmctl.engine.lora``): those served from the start (name, path),
    how many are resident at once (``max_loras``, also the most one step mixes) and the
    largest rank a resident slot holds."""

    adapters: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    max_rank: int = 16


@dataclass(frozen=True)
class EngineConfig(Generic[Extra]):
    block_size: int  # tokens per KV-cache block: the user's cache_block_seq_len
    kv_budget: KVBudget = KVBudget("fraction", 0.8)  # cache_max_entry_count
    max_model_len: int | None = None  # session_len; None: the model's own
    max_num_seqs: int = 256  # max_batch_size: most sequences in one step
    max_num_batched_tokens: int = 8192  # max_prefill_token_num: most new tokens in one step
    enable_prefix_caching: bool = True
    seed: int = 0
    dtype: str = "auto"  # auto (the checkpoint's on GPU, float32 on CPU) or a dtype name
    device: str = "auto"  # auto, cpu or cuda
    cpu_threads: int | None = None  # None: torch's count
    quantization: str = "none"  # weights: none, int8, int4 or gguf
    quantization_group_size: int | None = None  # None: int8 per channel, int4 in groups of 32
    quantization_zero_point: bool | None = None  # int4: asymmetric (Q4_1, the default)
    kv_cache_dtype: str = "auto"  # auto (the model dtype), int8 or fp8
    cuda_graphs: bool = True  # decode replays CUDA graphs (on CUDA only)
    chat_template: str | None = None  # replaces the model's own template
    served_model_name: str | None = None  # the API's model name (model_name); None: the model
    speculation: SpeculativeConfig = SpeculativeConfig()  # off unless speculative_method is set
    lora: LoraConfig = LoraConfig()  # adapters served from the start; slots
    extra: Extra | None = None  # what only this backend has

    def __post_init__(self) -> None:
        for field, option in (
            ("block_size", "cache_block_seq_len"),
            ("max_num_seqs", "max_batch_size"),
            ("max_num_batched_tokens", "max_prefill_token_num"),
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise OptionError(f"{option} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise OptionError(f"session_len must be a positive integer, got {self.max_model_len}")

    def runner_options(self, dtype: Any, device: Any, max_model_len: int) -> dict[str, Any]:
        """What both local runners take from this configuration (``PagedRunner``'s options,
        the weights' quantization, the LoRA slots), beside the dtype, device and session
        length the engine settles once the model is known (``assemble.build_engine``)."""
        return dict(
            dtype=dtype,
            device=device,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            cpu_threads=self.cpu_threads,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            cuda_graphs=self.cuda_graphs,
            # verification steps (the last token and k proposals) replay graphs too
            num_speculative_tokens=self.speculation.num_tokens if self.speculation.enabled else 0,
            quantization=self.quantization,
            max_loras=self.lora.max_loras,
            max_lora_rank=self.lora.max_rank,
        )

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any], extra: Extra | None = None
    ) -> EngineConfig[Extra]:
        """The one place the unified option names map to the engine's."""
        return cls(
            block_size=options["cache_block_seq_len"],
            kv_budget=parse_kv_budget(options["cache_max_entry_count"]),
            max_model_len=options["session_len"],
            max_num_seqs=options["max_batch_size"],
            max_num_batched_tokens=options["max_prefill_token_num"],
            enable_prefix_caching=options["enable_prefix_caching"],
            seed=options["seed"],
            dtype=options["dtype"],
            device=options["device"],
            cpu_threads=options["cpu_threads"],
            quantization=options["quantization"],
            quantization_group_size=options.get("quantization_group_size"),
            quantization_zero_point=options.get("quantization_zero_point"),
            kv_cache_dtype=options["kv_cache_dtype"],
            cuda_graphs=options["cuda_graphs"],
            chat_template=options["chat_template"],
            served_model_name=options["model_name"],
            speculation=SpeculativeConfig(
                method=options.get("speculative_method", "none"),
                num_tokens=options.get("num_speculative_tokens", 4),
                ngram_max=options.get("ngram_max", 4),
                ngram_min=options.get("ngram_min", 1),
                model=options.get("speculative_model"),
            ),
            lora=LoraConfig(
                adapters=tuple((options.get("lora") or {}).items()),
                max_loras=options.get("max_loras", 4),
                max_rank=options.get("max_lora_rank", 16),
            ),
            extra=extra,
        )
