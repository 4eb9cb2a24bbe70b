"""Chat prompts: the documented default, and a checkpoint's own jinja template (wherever
the folder keeps it)."""
from __future__ import annotations

import json
import shutil

import pytest

from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR
from specjax.chat import ChatTemplate
from specjax.tokenizer import Tokenizer
from specjax.validation import InvalidArgument

CHATML = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('system must come first') }}{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def folder_tokenizer(tmp_path, **files: str) -> Tokenizer:
    """The bundled tokenizer.json and config.json with the given extra files beside them."""
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(CHECKPOINTS_DIR / BUNDLED_TARGET / name, tmp_path / name)
    for name, text in files.items():
        (tmp_path / name.replace("__", ".")).write_text(text)
    return Tokenizer.from_folder(tmp_path)


def test_default_template_without_tokenizer_config(tmp_path):
    template = ChatTemplate.from_tokenizer(folder_tokenizer(tmp_path))
    assert template.add_bos is None  # the tokenizer decides, as for any text prompt
    assert template.render(MESSAGES) == "system: Be brief.\nuser: Hi\nassistant: "
    assert ChatTemplate.from_tokenizer(None).source is None


def test_checkpoint_template_is_rendered(tmp_path):
    tokenizer = folder_tokenizer(tmp_path, tokenizer_config__json=json.dumps(
        {"chat_template": "{{ bos_token }}" + CHATML, "bos_token": {"content": "<s>"},
         "eos_token": "</s>"}))
    template = ChatTemplate.from_tokenizer(tokenizer)
    assert template.add_bos is False  # the template writes its own special tokens
    bos = tokenizer.token_text(tokenizer.bos_token_id)
    assert template.render(MESSAGES) == (f"{bos}<|im_start|>system\nBe brief.<|im_end|>\n"
                                         "<|im_start|>user\nHi<|im_end|>\n"
                                         "<|im_start|>assistant\n")


def test_named_templates_pick_default(tmp_path):
    tokenizer = folder_tokenizer(tmp_path, tokenizer_config__json=json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML}]}))
    assert ChatTemplate.from_tokenizer(tokenizer).source == CHATML


def test_template_in_chat_template_jinja(tmp_path):
    """transformers 5 writes the template to its own file, not tokenizer_config.json."""
    tokenizer = folder_tokenizer(tmp_path, chat_template__jinja=CHATML,
                                 tokenizer_config__json=json.dumps({"add_bos_token": False}))
    assert ChatTemplate.from_tokenizer(tokenizer).source == CHATML
    assert not tokenizer.add_bos_token
    assert tokenizer.encode("Hi", add_bos=None)[:1] != [tokenizer.bos_token_id]


def test_template_exceptions_are_request_errors():
    with pytest.raises(InvalidArgument, match="system must come first") as info:
        ChatTemplate(CHATML).render(list(reversed(MESSAGES)))
    assert info.value.param == "messages"


def test_template_runs_sandboxed():
    sneaky = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidArgument):
        ChatTemplate(sneaky).render(MESSAGES)
