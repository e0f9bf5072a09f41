"""vLLM's run-time LoRA endpoints: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, behind the API key like every ``/v1`` route.

Loading reads and checks the adapter on a worker thread and registers it between two
engine steps: requests in flight go on undisturbed, and from then on ``model: NAME``
picks it (it is listed in ``/v1/models`` with the base model as ``parent``). Unloading
retires the name at once (a new request for it gets 404, as an unknown model), lets the
requests already using the adapter finish with it, and answers once they have and its
memory is freed: the call waits rather than refusing with a 409 (docs/lora.md).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from llmctl.backend import capabilities
from llmctl.errors import ModelError
from llmctl.model.lora import LoraNameError
from llmctl.server.errors import APIError
from llmctl.server.openapi import GATE_ERRORS, error_responses
from llmctl.server.protocol_base import Strict
from llmctl.server.state import ServerState

router = APIRouter(prefix="/v1")


# A name requests can give as their `model`: no surrounding spaces (check_lora_name).
NAME_PATTERN = r"^\S(.*\S)?$"


class LoadLoraAdapterRequest(Strict):
    lora_name: str = Field(
        description="The name requests use as their `model`.", pattern=NAME_PATTERN
    )
    lora_path: str = Field(
        description="A PEFT adapter directory on the server (adapter_config.json + "
        "adapter_model.safetensors).",
        min_length=1,
    )


class UnloadLoraAdapterRequest(Strict):
    lora_name: str = Field(description="The adapter's name, as it was loaded.", min_length=1)
    lora_int_id: int | None = Field(None, description="Accepted for vLLM's clients; unused.")


def _serving_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.llmctl
    if not capabilities(state.engine).serves_lora:
        raise APIError(
            501,
            f"the {state.backend_name} backend serves no LoRA adapters here: use "
            "--backend torch, or turbo on the CPU",
            type="server_error",
            code="not_implemented",
        )
    return state


def _adapter(state: ServerState, name: str, status: str) -> dict[str, Any]:
    return {
        "object": "lora_adapter",
        "id": name,
        "parent": state.engine.model_name,
        "status": status,
    }


@router.post("/load_lora_adapter", responses=error_responses(400, 501, *GATE_ERRORS))
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> dict[str, Any]:
    """Serve the adapter at `lora_path` as `lora_name`, from the next engine step on."""
    state = _serving_state(request)
    try:
        await capabilities(state.engine).load_lora(body.lora_name, body.lora_path)
    except LoraNameError as exc:
        raise APIError(400, str(exc), param="lora_name", code="invalid_lora_name") from None
    except ModelError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return _adapter(state, body.lora_name, "loaded")


@router.post("/unload_lora_adapter", responses=error_responses(400, 404, 501, *GATE_ERRORS))
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> dict[str, Any]:
    """Stop serving `lora_name`; answers once the requests using it have finished."""
    state = _serving_state(request)
    try:
        await capabilities(state.engine).unload_lora(body.lora_name)
    except KeyError:
        raise APIError(
            404,
            f"no LoRA adapter named {body.lora_name!r} is loaded (see GET /v1/models)",
            param="lora_name",
            code="model_not_found",
        ) from None
    return _adapter(state, body.lora_name, "unloaded")
