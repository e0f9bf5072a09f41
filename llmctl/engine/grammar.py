"""Grammar-constrained decoding: a request's output follows a JSON schema, a regex, a
list of choices or an EBNF grammar.

Built on xgrammar (vLLM's and SGLang's default). Why xgrammar over llguidance: its
masks come as a packed bitmask applied to the logits in place
(``apply_token_bitmask_inplace``: a CUDA kernel on a GPU, a C++ loop on the CPU), its
compiled grammars are plain objects cached by schema, and its tokenizer table takes the
raw bytes of each token, which llmctl already has (``model/token_bytes.py``) for the
demo model, SentencePiece-style and byte-level BPE tokenizers alike.

The parts:
- ``GrammarCompiler`` compiles a ``StructuredOutput`` on its own thread and caches the
  result by the spec itself, so the step loop never compiles: the async engine awaits
  the compile before the request enters the batch, and a bad schema is an
  ``InvalidRequest`` (400) there, never a failed step.
- ``GrammarState`` is one sequence's matcher: it accepts each token the sequence gets
  and says which tokens may come next. A preempted sequence keeps its tokens and so its
  matcher's state: recompute re-runs the model, not the grammar.
- ``GrammarMasks`` fills the bitmask of a step's constrained rows on another thread
  while the model runs; the sampler waits for it and applies it to those rows only.
  Unconstrained rows are never touched.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from llmctl.engine.sampling_params import StructuredOutput
from llmctl.errors import InvalidRequest
from llmctl.model.token_bytes import token_pieces
from llmctl.model.tokenizer import Tokenizer

# JSON Schema keywords xgrammar accepts but does not enforce (checked on its output): a
# schema using one is refused by name rather than followed only partly. ``allOf`` of
# more than one schema and ``uniqueItems: true`` are refused the same way (see
# ``_unenforced``); ``format`` is let through, unenforced (pydantic writes it for
# dates and URLs, and a plain string is still valid JSON for it).
_UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "multipleOf",
    "contains",
    "minContains",
    "maxContains",
)

_LINE_BREAKS = b"\r\n"


def tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...], for_json: bool = False
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: each token id's bytes in decoded text.

    Special tokens (BOS, EOS...) get no bytes, so a grammar never produces them; the
    stop ids are what a finished grammar allows. ``vocab_size`` is the model's (its
    logits may be wider than the tokenizer's vocabulary; the extra ids get no bytes).
    ``for_json``: tokens holding a control character other than a line break get no
    bytes either. JSON never needs one raw, and xgrammar's rule for a string with
    ``maxLength`` (``[^"\\\r\n]``) would let NUL or a tab through, which no JSON parser takes.
    """
    pieces = token_pieces(tokenizer)
    if pieces is None:
        raise InvalidRequest(
            "structured output needs each token's bytes, and this model's tokenizer "
            "decoder is not one llmctl reads (ByteLevel, Metaspace, ByteFallback); "
            "drop response_format / structured_outputs for this model",
            code="unsupported_grammar",
        )
    encoded = [b""] * vocab_size
    for token_id, piece in enumerate(pieces.pieces[:vocab_size]):
        if token_id in pieces.special or (
            for_json and any(b < 0x20 and b not in _LINE_BREAKS for b in piece)
        ):
            continue
        encoded[token_id] = piece
    return xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
    )


class GrammarCompiler:
    """Compiles specs off the step loop (one thread of its own) and caches them by spec.

    The tokenizer table is built on the first compile (it walks the whole vocabulary),
    so engines that never see a grammar never pay for it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = stop_ids
        # By ``for_json`` (see tokenizer_info): JSON grammars get a table of their own.
        self._compilers: dict[bool, xgr.GrammarCompiler] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="llmctl-grammar")
        self._lock = threading.Lock()  # guards _cache
        self._cache: dict[StructuredOutput, Future] = {}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, spec: StructuredOutput) -> Future:
        """A future of the compiled grammar; it raises ``InvalidRequest`` for a bad spec.
        A spec compiled before returns its (done) future at once."""
        with self._lock:
            future = self._cache.get(spec)
            if future is None:
                future = self._cache[spec] = self._executor.submit(self._compile, spec)
        return future

    def compiled(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar, waiting for the compile if it still runs."""
        return self.compile(spec).result()

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        kind, value = spec.kind, spec.value
        for_json = kind in ("json", "json_schema", "structural_tag")
        compiler = self._compilers.get(for_json)
        if compiler is None:
            info = tokenizer_info(self._tokenizer, self._vocab_size, self._stop_ids, for_json)
            compiler = self._compilers[for_json] = xgr.GrammarCompiler(info, max_threads=1)
        try:
            if kind == "json":  # OpenAI's json_object: an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                _check_schema(value)
                # No free whitespace: a model that likes spaces could otherwise fill
                # its whole budget with them (vLLM turns it off for the same reason).
                return compiler.compile_json_schema(value, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(value))
            if kind == "structural_tag":
                for tag in json.loads(value)["format"]["tags"]:
                    _check_schema(json.dumps(tag["content"]["json_schema"]))
                return compiler.compile_structural_tag(value)
            if kind == "lark":  # xgrammar's own Lark reader: line and column in its errors
                return compiler.compile_grammar(xgr.Grammar.from_lark(value))
            return compiler.compile_grammar(value)
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses
            lines = _SOURCE_PREFIX.sub("", str(exc).strip()).splitlines()
            problem = lines[0] if lines else repr(exc)
            raise InvalidRequest(
                f"the {_NAMES[kind]} does not compile: {problem}",
                code="invalid_grammar",
            ) from None


# xgrammar's C++ errors carry "[11:54:17] /project/cpp/regex_converter.cc:94: ": not the
# user's concern.
_SOURCE_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")


_NAMES = {
    "json": "JSON grammar",
    "json_schema": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "ebnf": "grammar",
    "lark": "Lark grammar",
    "structural_tag": "tool-call grammar",
}


def _check_schema(text: str) -> None:
    """Refuse what xgrammar would silently not enforce, naming the keyword."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"the JSON schema is not JSON: {exc}", code="invalid_grammar"
        ) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("a JSON schema is an object (or true/false)", code="invalid_grammar")

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for key, child in node.items():
                if _unenforced(key, child) and path.rsplit("/", 1)[-1] != "properties":
                    raise InvalidRequest(
                        f"the JSON schema uses {key!r} at {path or '/'}, which structured "
                        f"output cannot enforce; rewrite it without {key!r}",
                        code="unsupported_grammar",
                    )
                walk(child, f"{path}/{key}")
        elif isinstance(node, list):
            for index, child in enumerate(node):
                walk(child, f"{path}/{index}")

    walk(schema, "")


def _unenforced(key: str, value: object) -> bool:
    if key == "allOf":
        return isinstance(value, list) and len(value) > 1
    if key == "uniqueItems":
        return value is True
    return key in _UNSUPPORTED_KEYWORDS


def _choice_grammar(value: str) -> str:
    """An EBNF rule matching exactly one of the strings (a JSON list)."""
    choices = json.loads(value)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(
            "choice must be a list of non-empty strings", param="choice", code="invalid_grammar"
        )
    # JSON string escapes are EBNF string escapes too (quotes, backslashes, \\uXXXX).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarState:
    """One sequence's matcher: advanced by each token the sequence is given."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarMasks:
    """Fills the next-token masks of a step's constrained rows on a thread of its own,
    so the host work overlaps the model call (xgrammar releases the GIL, as torch does)."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="llmctl-grammar-mask")

    def start(self, grammars: list[GrammarState | None]) -> Future | None:
        """Begin filling the masks of a step's rows (each row's grammar, ``None`` where it
        is unconstrained); ``None`` when no row is constrained. The future gives
        ``(bitmask, rows)``."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return None
        states = [grammars[row] for row in rows]
        return self._executor.submit(self._fill, len(grammars), rows, states)

    def _fill(
        self, num_rows: int, rows: list[int], states: list[GrammarState]
    ) -> tuple[torch.Tensor, list[int]]:
        bitmask = xgr.allocate_token_bitmask(num_rows, self._vocab_size)
        for row, state in zip(rows, states):
            state.fill(bitmask, row)
        return bitmask, rows


def apply_masks(logits: torch.Tensor, masks: tuple[torch.Tensor, list[int]]) -> None:
    """Set the logits a row's grammar forbids to ``-inf``, in place, on the logits'
    device (the bitmask travels there packed: 32 tokens a word)."""
    bitmask, rows = masks
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
