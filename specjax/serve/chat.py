"""Chat messages -> one prompt string.

A checkpoint whose `tokenizer_config.json` has a `chat_template` is rendered with it (jinja2 in
a sandbox, the way Hugging Face does: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`). Otherwise the plain default below is used: one
"<role>: <content>" line per message, then "assistant: " for the model to continue.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from specjax.validation import InvalidArgument, shown

DEFAULT_TEMPLATE_DOC = ('one "<role>: <content>" line per message, then "assistant: " '
                        "(used when the checkpoint has no chat_template)")


def _token_text(value: Any) -> str:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """Renders chat messages; `add_bos` says whether the encoder should prepend BOS itself
    (the default template: yes; a checkpoint template writes its own special tokens)."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = source is None
        self._template = None
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(source)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike | None) -> "ChatTemplate":
        """The folder's template if its tokenizer_config.json has one, else the default."""
        path = Path(folder) / "tokenizer_config.json" if folder is not None else None
        if path is None or not path.exists():
            return cls()
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: take "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            return cls()
        return cls(source, _token_text(config.get("bos_token")),
                   _token_text(config.get("eos_token")))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """`messages` are {"role", "content"} dicts with string content."""
        if self._template is None:
            lines = [f"{m['role']}: {m['content']}\n" for m in messages]
            return "".join(lines) + "assistant: "
        from jinja2 import TemplateError
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            # The template's message may quote the messages: bounded, as every echo is.
            raise InvalidArgument("messages", f"the model's chat template rejected the "
                                              f"messages: {shown(str(e), 300)}") from None


def _raise_template_error(message: str) -> None:
    from jinja2 import TemplateError
    raise TemplateError(message)
