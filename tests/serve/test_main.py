"""`python -m specjax.serve`: argument handling, the default speculative mode, and one real
start-up as a subprocess on a saved tiny checkpoint with its own chat template."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from flax import nnx
from live_server import TINY_SERVE, free_port

from specjax.models import Llama, save_hf_checkpoint
from specjax.models.registry import BUNDLED_TARGET, CHECKPOINTS_DIR, resolve_model_path
from specjax.serve import __main__ as cli
from specjax.serve.defaults import (default_speculative_config, parse_speculative_config,
                                    served_model_name)
from specjax.speculative.config import (DFlashConfig, DraftTargetConfig, EagleConfig, MTPConfig,
                                        NGramConfig, PARDConfig)
from specjax.speculative.defaults import EXAMPLES


def test_default_speculation_is_eagle3_for_the_bundled_model(tmp_path):
    spec = default_speculative_config("bundled")
    assert isinstance(spec, EagleConfig) and spec.max_draft_len == 4
    assert spec.speculative_model == "bundled-eagle3"  # resolves from any directory
    assert resolve_model_path(spec.speculative_model) == CHECKPOINTS_DIR / "stdlib-eagle3"
    # Sampled requests (OpenAI's default temperature is 1) accept by rejection sampling.
    assert spec.use_rejection_sampling is True
    assert default_speculative_config(tmp_path) is None
    assert parse_speculative_config(None, "bundled") == spec
    assert parse_speculative_config("none", "bundled") is None
    assert parse_speculative_config("default", "bundled") == spec
    assert parse_speculative_config("default", tmp_path) is None   # no default: plain


def test_speculative_config_from_json_or_file(tmp_path):
    ngram = NGramConfig(max_draft_len=3)
    assert parse_speculative_config(ngram.to_json(), tmp_path) == ngram
    path = tmp_path / "spec.json"
    path.write_text(ngram.to_json())
    assert parse_speculative_config(str(path), tmp_path) == ngram
    with pytest.raises(ValueError, match="neither 'none', a mode name .*JSON, nor a file"):
        parse_speculative_config("ngrm", tmp_path)
    with pytest.raises(ValueError, match="--speculative-config"):
        parse_speculative_config('{"mode": 6, "max_draft_len": 0}', tmp_path)
    with pytest.raises(ValueError, match="unknown speculative decoding mode 'eagle4'.*eagle3"):
        parse_speculative_config('{"mode": "eagle4"}', tmp_path)


@pytest.mark.parametrize("value, expected", [
    ("ngram", NGramConfig()),
    ("NGRAM", NGramConfig()),
    ("6", NGramConfig()),
    ('{"mode": "ngram", "max_draft_len": 3}', NGramConfig(max_draft_len=3)),
    ("eagle3", EagleConfig(speculative_model="bundled-eagle3")),
    ("eagle3_one_model", EagleConfig(speculative_model="bundled-eagle3")),
    ('{"mode": "eagle3", "max_draft_len": 2}',
     EagleConfig(max_draft_len=2, speculative_model="bundled-eagle3")),
    ("draft-target", DraftTargetConfig(speculative_model="bundled-draft")),
    ("mtp", MTPConfig(max_draft_len=3, num_nextn_predict_layers=3, use_mtp_vanilla=True,
                      speculative_model="bundled-mtp")),
    ('{"mode": "mtp", "max_draft_len": 2}',
     MTPConfig(max_draft_len=2, num_nextn_predict_layers=3, use_mtp_vanilla=True,
               speculative_model="bundled-mtp")),
    ('{"mode": "eagle3", "speculative_model": "my/head"}', EagleConfig(speculative_model="my/head")),
    ("pard", PARDConfig(speculative_model="bundled-pard")),
    ("12", PARDConfig(speculative_model="bundled-pard")),
    ('{"mode": "dflash", "max_draft_len": 6}',
     DFlashConfig(max_draft_len=6, speculative_model="bundled-dflash")),
])
def test_speculative_config_by_mode_name(value, expected):
    """Mode names and short forms; for the bundled target the shipped drafter fills in."""
    assert parse_speculative_config(value, "bundled") == expected


def test_mode_names_without_a_shipped_drafter(tmp_path):
    # Another target gets no shipped drafter: the mode's own defaults, or its own error.
    assert parse_speculative_config("eagle3", tmp_path) == EagleConfig()
    with pytest.raises(ValueError, match="speculative_model is required"):
        parse_speculative_config("draft_target", tmp_path)
    with pytest.raises(ValueError, match="PARDConfig needs speculative_model"):
        parse_speculative_config("pard", tmp_path)


def test_help_lists_every_option_with_its_default_and_an_example_per_mode(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for action in cli.build_parser()._actions:
        if action.dest != "help":
            assert action.help, action.dest
    assert text.count("(default:") == len(cli.build_parser()._actions) - 1
    for example in EXAMPLES.values():
        assert " ".join(example.split()) in text


def test_served_model_name(tmp_path):
    assert served_model_name("bundled") == BUNDLED_TARGET
    assert served_model_name(tmp_path / "my-model") == "my-model"


@pytest.mark.parametrize("argv, message", [
    (["--speculative-config", "{not json"], "--speculative-config"),
    (["--model", "/nonexistent/folder", "--speculative-config", "none"], "neither a known name nor an existing local folder"),
    (["--port", "70000"], "--port"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--max-tokens-cap", "0"], "max_tokens_cap"),
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
    (["--allowed-hosts", "example.com:8000"], "no port"),
    (["--allowed-hosts", ","], "--allowed-hosts is empty"),
    (["--max-concurrency", "0"], "max_concurrency"),
    (["--request-timeout", "0"], "request_timeout"),
    (["--shutdown-timeout", "-1"], "shutdown_timeout"),
    (["--num-processes", "2"], "needs both --coordinator-address"),
    (["--coordinator-address", "127.0.0.1:1"], "needs both --coordinator-address"),
    (["--coordinator-address", "nohost", "--num-processes", "2"], "must be HOST:PORT"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "process_id must be in 0..1"),
    (["--tensor-parallel-size", "3"], "tensor_parallel_size 3 needs 3 devices; 1 available"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be a positive int"),
])
def test_bad_arguments_exit_2_before_loading(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("SPECJAX_API_KEY", raising=False)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_empty_api_key_in_the_environment_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("SPECJAX_API_KEY", "")
    assert cli.main([]) == 2
    assert "$SPECJAX_API_KEY is empty" in capsys.readouterr().err
    assert cli.api_key_from(None, {"SPECJAX_API_KEY": "k"}) == "k"
    assert cli.api_key_from("flag", {"SPECJAX_API_KEY": ""}) == "flag"   # the flag wins
    assert cli.api_key_from(None, {}) is None



def test_serve_subprocess_with_checkpoint_chat_template(tmp_path, bundled_tokenizer):
    folder = tmp_path / "tiny-ckpt"
    save_hf_checkpoint(Llama(TINY_SERVE, rngs=nnx.Rngs(3)), folder)
    shutil.copy(CHECKPOINTS_DIR / BUNDLED_TARGET / "tokenizer.json", folder)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    port, key = free_port(), "env-key"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specjax.serve", "--model", str(folder), "--port", str(port),
         "--speculative-config", "none", "--max-batch-size", "1", "--log-level", "warning"],
        env={**os.environ, "SPECJAX_API_KEY": key}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.25)
        body = {"model": "tiny-ckpt", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401
        assert httpx.head(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/health", headers={"Host": "evil.example.com"}).status_code \
            == 400
        response = httpx.post(f"{url}/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        rendered = bundled_tokenizer.encode("<|user|>hi<|assistant|>")  # no BOS: template's
        assert usage == {"prompt_tokens": len(rendered), "completion_tokens": 3,
                         "total_tokens": len(rendered) + 3}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0


@pytest.mark.parametrize("flag, enabled", [([], True), (["--no-prefix-cache"], False)])
def test_no_prefix_cache_reaches_the_llm(flag, enabled, monkeypatch, capsys):
    """The flag parses and becomes LLM(enable_prefix_cache=...); the stand-in LLM stops main
    before anything loads."""
    import specjax.llm
    seen = {}

    def fake_llm(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stand-in LLM: stop here")

    monkeypatch.setattr(specjax.llm, "LLM", fake_llm)
    monkeypatch.delenv("SPECJAX_API_KEY", raising=False)
    assert cli.main(["--speculative-config", "none", *flag]) == 2
    assert "stand-in LLM" in capsys.readouterr().err
    assert seen["enable_prefix_cache"] is enabled
