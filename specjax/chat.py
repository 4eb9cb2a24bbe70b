"""Chat messages -> one prompt string.

A model whose tokenizer has a chat template (`Tokenizer.chat_template`: a folder's
`tokenizer_config.json` or `chat_template.jinja`, a GGUF's `tokenizer.chat_template`) is rendered
with it (jinja2 in a sandbox, the way Hugging Face does: `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `raise_exception`). Otherwise the plain default below is used: one
"<role>: <content>" line per message, then "assistant: " for the model to continue.
"""
from __future__ import annotations

from typing import Sequence

from specjax.tokenizer import Tokenizer
from specjax.validation import InvalidArgument, shown

DEFAULT_TEMPLATE_DOC = ('one "<role>: <content>" line per message, then "assistant: " '
                        "(used when the checkpoint has no chat_template)")


class ChatTemplate:
    """Renders chat messages; `add_bos` says whether the encoder should prepend BOS itself
    (the default template: as the tokenizer says, None; a model's template writes its own
    special tokens: False)."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = None if source is None else False
        self._template = None
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(source)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer | None) -> "ChatTemplate":
        """The tokenizer's template if it has one, else the default."""
        if tokenizer is None or tokenizer.chat_template is None:
            return cls()
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        return cls(tokenizer.chat_template, tokenizer.token_text(tokenizer.bos_token_id),
                   tokenizer.token_text(eos))

    def prompt_ids(self, tokenizer: Tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
        """The token ids of `messages` rendered: BOS prepended only where the default
        template leaves it to the tokenizer (a model's template writes its own)."""
        return tokenizer.encode(self.render(messages), add_bos=self.add_bos)

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
