"""A Hugging Face tokenizer loaded with the light ``tokenizers`` library, plus its chat
template rendered the way transformers renders it.

Read from the model directory (a GGUF file: from its metadata, ``from_gguf``):
``tokenizer.json`` (the tokenizer itself),
``tokenizer_config.json`` (BOS/EOS tokens, ``add_bos_token``, the chat template),
``chat_template.jinja`` (newer checkpoints keep the template there),
``generation_config.json`` and ``config.json`` (EOS ids).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from llmctl.errors import InvalidRequest, ModelError, OptionError
from llmctl.model.config import token_ids
from llmctl.model.files import describe, read_json_object

# GGUF file and chat_template option -> its Tokenizer (``Tokenizer.from_gguf``).
_GGUF_TOKENIZERS: dict[tuple[Path, str | None], Tokenizer] = {}


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool = False,
        eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        chat_template_file: Path | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        if add_bos_token is None:
            # Not configured: do what tokenizer.json's post-processor does.
            add_bos_token = self.bos_token_id is not None and self.bos_token_id in (
                tokenizer.encode("a", add_special_tokens=True).ids
            )
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        eos_ids = list(eos_token_ids)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        self.eos_token_ids = tuple(eos_ids)
        # Only GGUF files say so (tokenizer.ggml.add_eos_token): EOS after the text.
        self.add_eos_token = add_eos_token and eos_id is not None
        self._eos_id = eos_id
        self.chat_template = chat_template
        self._special_tokens = special_tokens or {}
        self.chat_template_file = chat_template_file  # None: from the chat_template option
        self._template = (
            _compile_template(chat_template, chat_template_file) if chat_template else None
        )

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load the tokenizer of a model directory (or of a GGUF file, from its metadata).

        ``chat_template`` overrides the model's own: a path to a template file or an
        inline Jinja template.
        """
        from llmctl.model.gguf import gguf_file

        if (gguf := gguf_file(path)) is not None:
            return cls.from_gguf(gguf, chat_template)
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelError(
                f"{path} has no tokenizer.json: llmctl reads fast (tokenizers) tokenizers "
                "only; convert a sentencepiece-only tokenizer with transformers "
                "(AutoTokenizer.from_pretrained(...).save_pretrained(...))"
            )
        config_file = path / "tokenizer_config.json"
        config = read_json_object(config_file, required=False)
        special = {
            name: _token_text(config.get(name), config_file, name)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if config.get(name) is not None
        }
        add_bos_token = config.get("add_bos_token")
        if add_bos_token is not None and not isinstance(add_bos_token, bool):
            raise ModelError(f"{config_file}: 'add_bos_token' must be true or false")
        eos_ids: list[int] = []
        for source in (path / "generation_config.json", path / "config.json"):
            content = read_json_object(source, required=False)
            for token_id in token_ids(content.get("eos_token_id"), str(source), "eos_token_id"):
                if token_id not in eos_ids:
                    eos_ids.append(token_id)
        if chat_template:
            template, origin = load_chat_template(chat_template), None
        else:
            template, origin = _model_chat_template(path, config)
        return cls(
            _read_tokenizer_json(tokenizer_file),
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            add_bos_token=add_bos_token,
            eos_token_ids=tuple(eos_ids),
            chat_template=template,
            chat_template_file=origin,
            special_tokens=special,
        )

    @classmethod
    def from_gguf(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer and chat template a GGUF file's metadata describes
        (``llmctl.model.gguf_tokenizer``); ``chat_template`` as for ``from_dir``. Built once
        per file and template: a large vocabulary takes a moment."""
        from llmctl.model.gguf import open_gguf
        from llmctl.model.gguf_tokenizer import tokenizer_arguments

        model = open_gguf(path)
        key = (model.path, chat_template)
        if key not in _GGUF_TOKENIZERS:
            arguments = tokenizer_arguments(model)
            if chat_template:
                arguments.update(
                    chat_template=load_chat_template(chat_template), chat_template_file=None
                )
            _GGUF_TOKENIZERS[key] = cls(arguments.pop("tokenizer"), **arguments)
        return _GGUF_TOKENIZERS[key]

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The ``tokenizers`` object itself (incremental detokenization reads its decoder)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def highest_token_id(self) -> int:
        """The largest id the tokenizer can produce: it must fit the model's embeddings."""
        return max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS first if the model wants
        one and the text does not already start with it (no double BOS)."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token and ids[-1:] != [self._eos_id]:
            ids.append(self._eos_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one token (e.g. ``▁the``), as logprobs show it."""
        return self._tokenizer.id_to_token(token_id) or ""

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the chat template, as transformers does: ``tools`` in
        OpenAI's shape, ``template_kwargs`` as extra variables (``enable_thinking``)."""
        if self._template is None:
            raise InvalidRequest("this model has no chat template; give a plain prompt")
        try:
            return self._template.render(
                **{**self._special_tokens, **(template_kwargs or {})},
                messages=[_text_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template refused these messages: {exc}") from None

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids for a conversation.

        With a template: the rendered text, encoded without adding special tokens (the
        template writes its own BOS, as transformers' ``apply_chat_template`` assumes).
        Without one: plain continuation of the message contents joined by newlines
        (an assistant's tool calls written as their JSON, so none is dropped), after
        one line per tool definition (its JSON), so the model sees the tools too.
        """
        if not messages:
            raise InvalidRequest("messages must not be empty")
        if self.chat_template is not None:
            text = self.apply_chat_template(messages, True, tools, template_kwargs)
            return self.encode(text, add_special_tokens=False)
        lines = [json.dumps(tool) for tool in tools or []]
        lines += [_plain_text(_text_message(m)) for m in messages]
        return self.encode("\n".join(lines))


def load_chat_template(value: str) -> str:
    """The ``chat_template`` option: a path to a template file, or an inline template."""
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise OptionError(
        f"chat_template {value!r} is neither an existing file nor a Jinja template "
        "(an inline template contains {{ ... }} or {% ... %})"
    )


def _model_chat_template(path: Path, config: dict[str, Any]) -> tuple[str | None, Path | None]:
    """The model's own chat template and the file it comes from (none: ``(None, None)``)."""
    config_file = path / "tokenizer_config.json"
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        if not all(isinstance(t, dict) for t in template):
            raise ModelError(
                f"{config_file}: 'chat_template' must be a string or a list of "
                '{"name": ..., "template": ...} objects'
            )
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if template is not None and not isinstance(template, str):
        raise ModelError(f"{config_file}: 'chat_template' must be a string (a Jinja template)")
    if template is not None:
        return template, config_file
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(), jinja_file
        except UnicodeDecodeError:
            raise ModelError(f"{jinja_file} is not UTF-8 text") from None
    return None, None


def _read_tokenizer_json(path: Path) -> HFTokenizer:
    """The tokenizers library's errors (``key must be a string``) name no file: check the
    JSON first, then let the library read it, and name the file either way."""
    try:
        text = path.read_text()
        json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(
            f"{path} is not valid JSON ({exc}); restore it from the model's original files"
        ) from None
    try:
        return HFTokenizer.from_str(text)
    except Exception as exc:  # the library raises plain Exception
        raise ModelError(
            f"{path} is not a tokenizer the tokenizers library can read ({exc}); restore it "
            "from the model's original files"
        ) from None


def _text_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is one string: text parts joined, other parts refused."""
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidRequest(f"each message needs a 'role' and a 'content', got {message!r}")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"only text message content is supported, got a {kind!r} part")
        parts.append(part.get("text", ""))
    return {**message, "content": "".join(parts)}


def _plain_text(message: dict[str, Any]) -> str:
    """A message's text for a model without a chat template: its content, then each
    tool call it made as ``{"name": ..., "arguments": ...}``."""
    parts = [message["content"]] if message["content"] else []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        parts.append(
            json.dumps({"name": function.get("name"), "arguments": function.get("arguments")})
        )
    return "\n".join(parts)


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` block, which marks the
    assistant's text for training masks: rendering it is rendering its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _compile_template(source: str, origin: Path | None) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders them in.

    A template that does not compile is the model's fault if it came from one of its
    files (``origin``), else the chat_template option's."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        if origin is not None:
            raise ModelError(
                f"{origin}: the chat template does not compile (line {exc.lineno}: {exc}); "
                "fix it there (without one, chat messages are joined into a plain prompt)"
            ) from None
        raise OptionError(
            f"the chat template given by chat_template (--chat-template) does not compile "
            f"(line {exc.lineno}: {exc})"
        ) from None


def _token_text(value: Any, source: Path, key: str) -> str:
    """A special token from tokenizer_config: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ModelError(f"{source}: {key!r} must be a token (a string), got {describe(value)}")
    return value
