"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (with ``add_special_tokens``) or chat ``messages`` (with
``add_generation_prompt``, ``tools`` and ``chat_template_kwargs``, rendered by the chat
template exactly as a chat request's prompt is) and answers ``{count, max_model_len,
tokens, token_strs}``; ``/detokenize`` turns ``tokens`` back into ``{prompt}``. Both
need the model's tokenizer in this process (a local backend); a proxy answers 501.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from llmctl.backend import capabilities
from llmctl.errors import InvalidRequest
from llmctl.model.tokenizer import Tokenizer
from llmctl.server.errors import APIError
from llmctl.server.openapi import GATE_ERRORS, error_responses
from llmctl.server.protocol import ChatMessage, TokenId
from llmctl.server.protocol_base import Strict
from llmctl.server.state import ServerState
from llmctl.server.tools import MAX_TOOLS, Tool, template_tools

router = APIRouter()
TOKENIZE_ERRORS = (400, 404, 501, *GATE_ERRORS)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = Field(None, description="Text to tokenize (or give messages).")
    add_special_tokens: bool = Field(True, description="With prompt: BOS if the model has one.")
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = Field(False, description="Also each token's vocabulary entry.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenizer(state: ServerState, model: str | None) -> Tokenizer:
    """The served model's tokenizer, once ``model`` is known to name it (or an adapter)."""
    state.check_model(model)
    tokenizer = capabilities(state.engine).tokenizer
    if tokenizer is None:
        raise APIError(
            501,
            f"the {state.backend_name} backend has no tokenizer in this process; ask the "
            "server it forwards to",
            type="server_error",
            code="not_implemented",
        )
    return tokenizer


@router.post(
    "/tokenize", response_model=TokenizeResponse, responses=error_responses(*TOKENIZE_ERRORS)
)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.llmctl
    tokenizer = _tokenizer(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest(
            "give prompt or messages (exactly one)", param="prompt", code="invalid_combination"
        )
    if body.prompt is not None:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        messages = [message.for_engine() for message in body.messages]
        tools = template_tools(body.tools) if body.tools else None
        if tokenizer.has_chat_template:
            text = tokenizer.apply_chat_template(
                messages, body.add_generation_prompt, tools, body.chat_template_kwargs
            )
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode_chat(messages, tools)
    strs = [tokenizer.token_text(t) for t in tokens] if body.return_token_strs else None
    return {
        "count": len(tokens),
        "max_model_len": state.engine.max_model_len,
        "tokens": tokens,
        "token_strs": strs,
    }


@router.post(
    "/detokenize", response_model=DetokenizeResponse, responses=error_responses(*TOKENIZE_ERRORS)
)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state: ServerState = request.app.state.llmctl
    tokenizer = _tokenizer(state, body.model)
    vocab_size = capabilities(state.engine).vocab_size or tokenizer.vocab_size
    bad = [t for t in body.tokens if t >= vocab_size]
    if bad:
        raise InvalidRequest(
            f"tokens {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})",
            param="tokens",
        )
    return {"prompt": tokenizer.decode(body.tokens)}
