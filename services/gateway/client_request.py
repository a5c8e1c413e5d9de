"""What a client asked the gateway for, as each front door decodes it once.

Lifecycle: the gRPC front door decodes a `GenerateRequest` with `from_generate`; the
OpenAI front door builds one from its parsed body (`openai.schema.to_client_request`).
Either way the model the request names is resolved here, once (`ModelCatalog.resolve`),
and the `ClientRequest` carries it. `GatewayService.stream` takes it: it tokenizes the
input with that model's tokenizer, runs the one request check (`engine.request_check`)
and builds the `RequestSpec` the workers get (`GatewayService.prepare`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.priority import Priority
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from pdserve.v1 import gateway_pb2
from services.common import request_codec, sampling
from services.gateway.models.catalog import ModelCatalog, Resolved


class InputKind(enum.Enum):
    """How a client gave its prompt."""

    TEXT = "prompt"  # a string, tokenized as is
    CHAT = "messages"  # a message list, through the model's chat template
    TOKENS = "prompt_token_ids"  # token ids, used as they are


@dataclass(frozen=True)
class PromptInput:
    """A prompt as the client sent it (one of the three kinds)."""

    kind: InputKind
    text: str = ""
    messages: tuple[ChatMessage, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClientRequest:
    """One request from a client: the model it names (resolved), its prompt, how to
    sample, its id ("": the gateway makes one) and the class it asks for (None: its
    key's default)."""

    model: Resolved
    prompt: PromptInput
    sampling: SamplingParams
    request_id: str = ""
    priority: Priority | None = None


def from_generate(msg: gateway_pb2.GenerateRequest, models: ModelCatalog) -> ClientRequest:
    """The gRPC front door's request. Raises UnknownModelError, or InvalidRequestError
    naming the field (`sampling.*`, `priority`, `input`)."""
    model = models.resolve(msg.model)
    return ClientRequest(
        model=model,
        prompt=_prompt(msg),
        sampling=sampling.from_proto(msg.sampling),
        request_id=msg.request_id,
        priority=request_codec.priority_from_proto(msg.priority),
    )


def _prompt(msg: gateway_pb2.GenerateRequest) -> PromptInput:
    which = msg.WhichOneof("input")
    if which == "prompt":
        return PromptInput(InputKind.TEXT, text=msg.prompt)
    if which == "messages":
        messages = tuple(ChatMessage(m.role, m.content) for m in msg.messages.messages)
        return PromptInput(InputKind.CHAT, messages=messages)
    if which == "prompt_token_ids":
        return PromptInput(InputKind.TOKENS, token_ids=tuple(msg.prompt_token_ids.ids))
    raise InvalidRequestError("input", "set prompt, messages or prompt_token_ids")
