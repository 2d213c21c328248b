"""A Hugging Face tokenizer read without transformers or torch: ``tokenizer.json`` plus its chat template.

Role: the controller tokenizes the job's prompts and the reward worker decodes responses; both
must stay torch-free (``import transformers`` pulls torch, about 4 s and hundreds of MB per
process). ``ChatTokenizer`` reads what ``save_pretrained`` writes into a model folder:

- ``tokenizer.json``: the fast tokenizer (the ``tokenizers`` library runs it);
- ``tokenizer_config.json``: special tokens (``bos_token``, ``eos_token``, ``pad_token``) and, in
  older folders, ``chat_template``;
- ``chat_template.jinja`` (newer folders): the chat template.

``apply_chat_template`` renders the template the way transformers does (a sandboxed jinja2
environment with ``raise_exception`` and ``tojson``, ``add_generation_prompt``) and encodes the
text without adding special tokens again, so the ids equal ``AutoTokenizer.apply_chat_template``'s
(checked in ``tests/workload/test_hf_path.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

Message = dict[str, Any]


class TokenizerError(ValueError):
    """The model folder's tokenizer is missing or unreadable; the message names the file."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(frozen=True)
class SpecialTokens:
    bos: str | None
    eos: str | None
    pad: str | None


class ChatTokenizer:
    """Encode prompts (plain text or chat messages) and decode responses, torch-free."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        tokenizer_file = self.model_dir / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: no such file (a fast tokenizer, tokenizer.json, is expected)")
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception
            raise TokenizerError(f"{tokenizer_file}: not a readable tokenizer ({exc})") from None
        config = self._read_config()
        self.special = SpecialTokens(_token_text(config.get("bos_token")), _token_text(config.get("eos_token")),
                                     _token_text(config.get("pad_token")))
        self.chat_template = self._read_chat_template(config)
        self.eos_id = self._id_of(self.special.eos)
        self.pad_id = self._id_of(self.special.pad)
        self.bos_id = self._id_of(self.special.bos)

    def _read_config(self) -> dict[str, Any]:
        path = self.model_dir / TOKENIZER_CONFIG_FILE
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
        return data if isinstance(data, dict) else {}

    def _read_chat_template(self, config: dict[str, Any]) -> str | None:
        path = self.model_dir / CHAT_TEMPLATE_FILE
        if path.is_file():
            return path.read_text()
        template = config.get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):  # a list of named templates: take "default"
            for entry in template:
                if isinstance(entry, dict) and entry.get("name") == "default":
                    return str(entry.get("template"))
        return None

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        found = self._tokenizer.token_to_id(token)
        return int(found) if found is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (text, not ids)."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.model_dir}: the tokenizer has no chat template "
                                 f"(expected {CHAT_TEMPLATE_FILE} or chat_template in {TOKENIZER_CONFIG_FILE})")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.special.bos or "", eos_token=self.special.eos or "", pad_token=self.special.pad or "")

    def encode_prompt(self, prompt: str | list[Message]) -> list[int]:
        """Ids of one prompt: a message list goes through the chat template; plain text is encoded
        as is (with the tokenizer's own special tokens, as ``tokenizer(text)`` would)."""
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        return self.encode(self.render_chat(prompt), add_special_tokens=False)


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """A sandboxed jinja2 template with the helpers HF chat templates use (cached per source)."""
    cached = _TEMPLATES.get(source)
    if cached is not None:
        return cached
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template: {message}")

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    _TEMPLATES[source] = template
    return template


def stop_token_ids(model_dir: str | Path) -> list[int]:
    """Tokens that end a response, first the main one: ``generation_config.json``'s
    ``eos_token_id`` (an id or a list), then the tokenizer's EOS. Raises ``TokenizerError`` when
    the folder names none."""
    folder = Path(model_dir)
    stops: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in stops:
                stops.append(token)
        if stops:
            break
    eos = ChatTokenizer(folder).eos_id
    if eos is not None and eos not in stops:
        stops.append(eos)
    if not stops:
        raise TokenizerError(f"{folder}: no end-of-sequence token (expected eos_token_id in generation_config.json "
                             "or eos_token in tokenizer_config.json)")
    return stops
