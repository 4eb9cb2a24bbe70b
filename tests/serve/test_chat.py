"""Chat prompts: the documented default, and a checkpoint's own jinja template."""
from __future__ import annotations

import json

import pytest

from specjax.serve.chat import ChatTemplate
from specjax.validation import InvalidArgument

CHATML = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('system must come first') }}{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_default_template_without_tokenizer_config(tmp_path):
    template = ChatTemplate.from_folder(tmp_path)
    assert template.add_bos
    assert template.render(MESSAGES) == "system: Be brief.\nuser: Hi\nassistant: "
    assert ChatTemplate.from_folder(None).source is None


def test_checkpoint_template_is_rendered(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}" + CHATML, "bos_token": {"content": "<s>"},
         "eos_token": "</s>"}))
    template = ChatTemplate.from_folder(tmp_path)
    assert not template.add_bos  # the template writes its own special tokens
    assert template.render(MESSAGES) == ("<s><|im_start|>system\nBe brief.<|im_end|>\n"
                                         "<|im_start|>user\nHi<|im_end|>\n"
                                         "<|im_start|>assistant\n")


def test_named_templates_pick_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML}]}))
    assert ChatTemplate.from_folder(tmp_path).source == CHATML


def test_template_exceptions_are_request_errors():
    with pytest.raises(InvalidArgument, match="system must come first") as info:
        ChatTemplate(CHATML).render(list(reversed(MESSAGES)))
    assert info.value.param == "messages"


def test_template_runs_sandboxed():
    sneaky = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidArgument):
        ChatTemplate(sneaky).render(MESSAGES)
