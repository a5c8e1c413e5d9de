"""Text <-> token ids for a model directory, and its chat template.

Lifecycle: built once per process from `tokenizer.json` (and `tokenizer_config.json` for
the chat template and special tokens); stateless afterwards and safe to share between
threads (the `tokenizers` library releases the GIL and keeps no per-call state).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer

from engine.errors import InvalidRequestError, ModelNotFoundError

CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """`tokenizer_config.json` of `model_dir` ({} without one)."""
    path = model_dir / "tokenizer_config.json"
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}


def read_chat_template(model_dir: Path) -> str | None:
    """The chat template: `chat_template.jinja` where there is one (newer transformers
    save it there, and it wins over the config's, as when transformers loads it), else
    `tokenizer_config.json`'s `chat_template`; None without either."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = read_tokenizer_config(model_dir).get("chat_template")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` with the model's special tokens and chat template."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{path} not found")
        self._tok = HfTokenizer.from_file(str(path))
        cfg = read_tokenizer_config(model_dir)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.chat_template = read_chat_template(model_dir)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(self.chat_template) if self.chat_template else None
        decoder = json.loads(path.read_text()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether `other` maps every token string to the same id (a draft model must)."""
        return bool(self._tok.get_vocab(with_added_tokens=True) == other._tok.get_vocab(
            with_added_tokens=True))  # fmt: skip

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.add_bos and bos_id is not None and (not ids or ids[0] != bos_id):
            ids = [bos_id, *ids]
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    @property
    def takes_tools(self) -> bool:
        """The chat template renders OpenAI `tools` itself (else the caller writes them
        into the system message)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> str:
        """The prompt text for a message list, by the model's own chat template; `tools`
        (OpenAI's list of function tools) reaches a template that `takes_tools`."""
        if self._template is None:
            raise InvalidRequestError("messages", "this model has no chat template; send a prompt")
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        for m in messages:
            if m.role not in CHAT_ROLES:
                raise InvalidRequestError("messages.role", f"must be one of {CHAT_ROLES}", m.role)
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({} if tools is None else {"tools": list(tools)}),
            )
        except TemplateError as exc:
            raise InvalidRequestError("messages", f"rejected by the chat template: {exc}") from exc

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (grammar engines index the vocabulary)."""
        return str(self._tok.to_str())

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a UTF-8
        character, so its text alone can lose them); log-probability answers show them."""
        surface = self._tok.id_to_token(token_id) or ""
        if self._byte_level and all(c in _BYTE_OF for c in surface):
            return bytes(_BYTE_OF[c] for c in surface)
        return surface.encode("utf-8")

    def encode_chat(
        self, messages: list[ChatMessage], *, tools: Sequence[Mapping[str, object]] | None = None
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools))


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte -> the byte (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the rest map to code points 256+)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF = _byte_alphabet()


def _token_text(value: object) -> str | None:
    # tokenizer_config.json spells special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
