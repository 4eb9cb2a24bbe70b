"""The ids that end generation: the tokenizer's own EOS, every end-of-turn token its chat
template writes, and for a ChatML model <|endoftext|> too."""
import tokenizers
from tokenizers import AddedToken, models

from specjax.tokenizer import Tokenizer

CHATML = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def backend(special: list[str]) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    return tok


def test_a_chatml_model_ends_at_im_end_and_endoftext():
    tok = Tokenizer(backend(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                    eos_token_ids=[4], chat_template=CHATML)
    assert tok.eos_token_ids == (4, 2)  # <|im_end|> (its EOS), then <|endoftext|>


def test_endoftext_ends_only_what_its_template_or_chatml_says():
    special = ["<|endoftext|>", "<end_of_turn>"]
    gemma_like = Tokenizer(backend(special), eos_token_ids=[3],
                           chat_template="{{ m }}<end_of_turn>")
    assert gemma_like.eos_token_ids == (3,)
    plain = Tokenizer(backend(["<|endoftext|>", "<|im_end|>"]), eos_token_ids=[])
    assert plain.eos_token_ids == ()  # no template: nothing but its EOS
    not_special = tokenizers.Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<unk>": 1},
                                                        unk_token="<unk>"))
    not_special.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    assert Tokenizer(not_special, chat_template=CHATML).eos_token_ids == (2,)
