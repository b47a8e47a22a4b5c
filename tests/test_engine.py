"""The Python API and the ``generate`` command: text in, text out, stats, stop strings, streaming, one-line errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from quasar_deploy.api import load
from quasar_deploy.cli import main
from quasar_deploy.engine import WARM_UP_BLOCK, Engine
from quasar_deploy.errors import QuasarError
from quasar_deploy.text import Detokenizer, StopStrings

from .helpers import assert_one_line_error, copy_dir
from .tiny import save_tiny

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"


@pytest.fixture(scope="module")
def engine(tiny_qwen3) -> Engine:
    return load(tiny_qwen3, backend="cpu")


def test_every_drafter_gives_the_plain_greedy_text(engine, tiny_llama):
    baseline = engine.generate(PROMPT, max_new_tokens=30, draft="none")
    assert baseline.stats.acceptance_length == 1.0 and baseline.stats.drafted == 0
    assert baseline.text == engine.tokenizer.decode(baseline.tokens, skip_special_tokens=True)
    for options in (
        dict(draft="ngram"),
        dict(draft="ngram", num_draft=2, ngram_min=2, ngram_max=4),
        dict(draft="layerskip", skip_layers=[2]),
        dict(draft="layerskip", skip_fraction=0.4),
        dict(draft="model", draft_model=tiny_llama, num_draft=3),
    ):
        result = engine.generate(PROMPT, max_new_tokens=30, **options)
        assert (result.tokens, result.text) == (baseline.tokens, baseline.text), options
        s = result.stats
        assert s.new_tokens == 30 and result.finish_reason == "length" and result.prompt_tokens == len(engine.encode(PROMPT))
        assert s.acceptance_length == pytest.approx(1 + s.accepted / s.verify_steps) and s.drafted >= s.accepted
        assert s.wall_s > 0 and s.tokens_per_s > 0 and min(s.prefill_s, s.draft_s, s.verify_s) >= 0
    assert engine.generate(PROMPT, max_new_tokens=30).stats.accepted > 0  # the repeated line gets drafted


def test_a_w8a8_artifact_loads_as_the_verifier(naive_artifact):
    w8a8 = load(naive_artifact, needs=("layer_skip",))  # the drafts below include layerskip
    assert "W8A8" in w8a8.lm.description
    baseline = w8a8.generate(PROMPT, max_new_tokens=25, draft="none")
    for draft in ("ngram", "layerskip"):
        assert w8a8.generate(PROMPT, max_new_tokens=25, draft=draft).tokens == baseline.tokens


def test_stream_pieces_add_up_to_the_text(engine):
    stream = engine.stream(PROMPT, max_new_tokens=25, temperature=0.9, seed=7)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == stream.result.text
    assert stream.result.tokens == engine.generate(PROMPT, max_new_tokens=25, temperature=0.9, seed=7).tokens


def test_sampling_is_seeded(engine):
    def text(seed, draft):
        return engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=100, seed=seed, draft=draft).text

    assert text(1, "ngram") == text(1, "ngram") and text(1, "layerskip") == text(1, "layerskip")
    assert text(1, "ngram") != text(2, "ngram")


def test_stop_strings_cut_the_text(engine):
    full = engine.generate(PROMPT, max_new_tokens=40, draft="none")
    stop = full.text[10:13]
    cut = full.text[: full.text.index(stop)]
    for draft in ("none", "ngram"):
        result = engine.generate(PROMPT, max_new_tokens=40, draft=draft, stop=[stop, "\x00never"])
        assert result.text == cut and result.finish_reason == "stop"
        assert len(result.tokens) < 40 and result.tokens == full.tokens[: len(result.tokens)]
        assert "".join(engine.stream(PROMPT, max_new_tokens=40, draft=draft, stop=stop)) == cut


def test_stop_tokens_end_generation(engine):
    full = engine.generate(PROMPT, max_new_tokens=30, draft="none")
    stop_id = full.tokens[12]
    stopping = Engine(engine.lm, engine.tokenizer, frozenset({stop_id}))
    result = stopping.generate(PROMPT, max_new_tokens=30)
    assert result.tokens == full.tokens[: full.tokens.index(stop_id) + 1] and result.finish_reason == "stop"


def test_stop_strings_hold_back_a_possible_start():
    stops = StopStrings(["bcd", "xy"])
    assert stops.push("ab") == ("a", False)
    assert stops.push("c") == ("", False)
    assert stops.push("e") == ("bce", False)
    assert stops.push("abx") == ("ab", False)
    assert stops.push("zbc") == ("xz", False)
    assert stops.push("dq") == ("", True)
    assert StopStrings([]).push("bcd") == ("bcd", False)


def test_detokenizer_never_splits_a_character(engine):
    text = "héllo 世界 🎉 naïve"
    ids = engine.tokenizer.encode(text)
    assert any("\ufffd" in engine.tokenizer.decode([i]) for i in ids)  # the tokenizer does split bytes
    detokenizer = Detokenizer(engine.tokenizer, [])
    pieces = [detokenizer.push(i) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_chat_messages_use_the_chat_template(engine, monkeypatch):
    messages = [{"role": "user", "content": "def f(x):"}]
    with pytest.raises(QuasarError, match="no chat template"):
        engine.generate(messages)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    monkeypatch.setattr(engine.tokenizer, "chat_template", template, raising=False)
    result = engine.generate(messages, max_new_tokens=5)
    assert result.prompt_tokens == len(engine.tokenizer.encode("<user>def f(x):\n<assistant>"))
    with pytest.raises(QuasarError, match="'role' and a string 'content'"):
        engine.generate([{"role": "user"}])


def test_token_id_prompts(engine):
    ids = engine.encode(PROMPT)
    assert engine.generate(ids, max_new_tokens=8).tokens == engine.generate(PROMPT, max_new_tokens=8).tokens


@pytest.mark.parametrize(
    "prompt,options,message",
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ("x " * 600, {}, "context window is 512"),
        ([5000], {}, "outside the vocabulary"),
        (PROMPT, {"num_draft": -1}, r"num_draft must be an integer >= 1 \(for plain decoding use draft='none'\), got -1"),
        (PROMPT, {"num_draft": 0, "draft": "layerskip"}, "num_draft must be an integer >= 1"),
        (PROMPT, {"top_p": 0.0, "temperature": 1.0}, r"top_p must be in \(0, 1\]"),
        (PROMPT, {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        (PROMPT, {"temperature": -0.5}, "temperature"),
        (PROMPT, {"draft": "medusa"}, "unknown drafter 'medusa'"),
        (PROMPT, {"stop": [""]}, "stop strings must be non-empty"),
        (PROMPT, {"stop": ["ok", ""]}, "stop strings must be non-empty"),
        (PROMPT, {"max_new_tokens": 0}, "max_new_tokens"),
        (PROMPT, {"ngram_min": 3, "ngram_max": 2}, "ngram_max"),
        (PROMPT, {"draft": "suffix", "suffix_min_prob": 1.0}, r"suffix_min_prob must be a number in \[0, 1\)"),
        (PROMPT, {"suffix_min_prob": 0.5}, "applies to draft=.suffix."),
        (PROMPT, {"adaptive_k": 1}, "adaptive_k must be true or false"),
        (PROMPT, {"draft": "none", "adaptive_k": True}, "adaptive_k needs a drafter"),
        (PROMPT, {"beam_width": 4}, "unknown generation option 'beam_width'"),
        (PROMPT, {"skip_layers": [1]}, "applies to draft='layerskip'"),
        (PROMPT, {"draft": "layerskip", "skip_layers": [7]}, "layer 7 does not exist"),
        (PROMPT, {"draft": "layerskip", "skip_fraction": 1.0}, r"skip_fraction must be in \(0, 1\)"),
        (PROMPT, {"draft": "layerskip", "skip_layers": [1], "skip_fraction": 0.5}, "not both"),
        (PROMPT, {"draft": "model"}, "needs draft_model"),
        (PROMPT, {"draft": "model", "draft_model": "/nonexistent/draft"}, "no such directory"),
        (PROMPT, {"seed": "abc"}, "seed must be an integer"),
    ],
)
def test_bad_input_is_one_quasar_error(engine, prompt, options, message):
    with pytest.raises(QuasarError, match=message):
        engine.stream(prompt, **options)


def test_draft_model_needs_the_same_tokenizer(engine, tiny_llama, tmp_path):
    other = copy_dir(tiny_llama, tmp_path, "other-tokenizer")
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(QuasarError, match="tokenizer differs from the verifier's"):
        engine.generate(PROMPT, draft="model", draft_model=other)


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(QuasarError, match="no such directory"):
        load(tmp_path / "missing")
    with pytest.raises(QuasarError, match="unknown backend"):
        load(tmp_path, backend="tpu")


# --- the generate command ------------------------------------------------------------------


def cli(*args, input=None):
    return CliRunner().invoke(main, ["generate", *(str(a) for a in args)], input=input)


def test_cli_streams_the_text_and_prints_stats(engine, tiny_qwen3):
    expected = engine.generate(PROMPT, max_new_tokens=12, draft="none")
    result = cli(tiny_qwen3, "--prompt", PROMPT, "--max-new-tokens", 12, "--stats", "--backend", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout == expected.text + "\n"
    assert "acceptance_length" in result.stderr and "tokens_per_s" in result.stderr
    stats = dict(line.strip().split(": ", 1) for line in result.stderr.splitlines() if line.strip())
    memory = ["vmrss_mib", "rssanon_mib", "estimated_mib"]
    assert list(stats) == ["backend", "finish_reason", *expected.stats.to_dict(), *memory]  # one "name: value" line per figure
    assert stats["backend"].startswith("cpu float, ") and "float kernel" in stats["backend"]
    assert 0 < float(stats["estimated_mib"]) < float(stats["rssanon_mib"]) <= float(stats["vmrss_mib"])
    assert stats["finish_reason"] == "length" and int(stats["new_tokens"]) == 12
    assert float(stats["acceptance_length"]) >= 1.0 and float(stats["tokens_per_s"]) > 0


def test_cli_json_and_prompt_file(engine, tiny_qwen3, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    result = cli(tiny_qwen3, "--prompt-file", prompt_file, "--max-new-tokens", 10, "--json", "--draft", "layerskip", "--skip-layers", "1")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    expected = engine.generate(PROMPT, max_new_tokens=10)
    assert out["tokens"] == expected.tokens
    assert out["stats"]["new_tokens"] == 10 and out["finish_reason"] == "length" and "text" in out
    assert (
        out["text"] == expected.text
        and out["prompt_tokens"] == expected.prompt_tokens
        and set(out["stats"]) == set(expected.stats.to_dict())
    )
    result = cli(tiny_qwen3, "--prompt-file", "-", "--max-new-tokens", 10, "--json", input=PROMPT)
    assert json.loads(result.stdout)["tokens"] == out["tokens"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "prompt is empty"),
        ([], "exactly one of --prompt or --prompt-file"),
        (["--prompt", "x", "--prompt-file", "-"], "exactly one of --prompt or --prompt-file"),
        (["--prompt", "x", "--stop", ""], "stop strings must be non-empty"),
        (["--prompt", "x", "--draft", "layerskip", "--skip-layers", "a,b"], "--skip-layers takes comma-separated"),
        (["--prompt", "x", "--chat"], "no chat template"),
        (["--prompt", "x " * 600], "context window"),
    ],
)
def test_cli_bad_input_is_one_line(tiny_qwen3, args, message):
    assert_one_line_error(cli(tiny_qwen3, *args), message, only_line=True)


def test_cli_missing_model(tmp_path):
    result = cli(tmp_path / "nope", "--prompt", "x")
    assert result.exit_code == 1 and result.output.startswith("error: ") and "no such directory" in result.output


@pytest.mark.parametrize(
    "args,flag",
    [
        (["-k", "-1"], "'--num-draft' / '-k'"),
        (["-k", "0"], "'--num-draft' / '-k'"),
        (["--top-p", "2"], "'--top-p'"),
        (["--max-new-tokens", "0"], "'--max-new-tokens'"),
        (["--temperature", "-1"], "'--temperature'"),
        (["--skip-fraction", "1"], "'--skip-fraction'"),
        (["--draft", "eagle"], "'--draft'"),
        (["--backend", "tpu"], "'--backend'"),
    ],
)
def test_cli_bad_values_name_the_flag(tiny_qwen3, args, flag):
    result = cli(tiny_qwen3, "--prompt", "x", *args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"Invalid value for {flag}" in result.output, result.output


def test_cli_choices_come_from_the_registries():
    from quasar_deploy.backends import BACKENDS
    from quasar_deploy.speculative.registry import DRAFTERS

    options = {p.name: p for p in main.commands["generate"].params}
    assert list(options["draft"].type.choices) == list(DRAFTERS)
    assert list(options["backend"].type.choices) == ["auto", *BACKENDS] and "cuda" in BACKENDS


def test_cli_error_while_streaming_is_one_line(tiny_qwen3, monkeypatch):
    from quasar_deploy.backends.torch_backend import TorchCausalLM

    calls = []
    verify = TorchCausalLM.verify

    def failing(self, ids):
        calls.append(ids)
        if len(calls) > WARM_UP_BLOCK + 3:  # past load's warm-up and a few generated tokens
            raise QuasarError("the device went away")
        return verify(self, ids)

    monkeypatch.setattr(TorchCausalLM, "verify", failing)
    result = cli(tiny_qwen3, "--prompt", PROMPT, "--draft", "none", "--max-new-tokens", 20, "--backend", "cpu")
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0] and lines[-1] == "error: the device went away", result.output


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("short-context"), "qwen3", max_position_embeddings=30)


def test_the_context_window_ending_a_generation_is_flagged(short_context_model):
    engine = load(short_context_model, backend="cpu")
    prompt = engine.encode(PROMPT)
    result = engine.generate(prompt, max_new_tokens=50, draft="none")
    assert len(result.tokens) == 30 - len(prompt) and result.finish_reason == "length" and result.context_full
    assert not engine.generate(prompt, max_new_tokens=5).context_full


def test_cli_warns_when_the_context_window_ends_the_generation(short_context_model):
    result = cli(short_context_model, "--prompt", PROMPT, "--max-new-tokens", 50, "--json", "--backend", "cpu")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["context_full"] and out["finish_reason"] == "length"
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: the context window (30 tokens) ended the generation"), result.stderr
    assert f"after {len(out['tokens'])} of 50 new tokens" in warnings[0]


def test_skip_fractions_share_one_greedy_order(tiny_qwen3, monkeypatch):
    """A larger fraction continues the order a smaller one measured; a smaller one takes its prefix without a forward."""
    from quasar_deploy import engine as engine_module

    calls = []
    order = engine_module.skip_order
    monkeypatch.setattr(engine_module, "skip_order", lambda lm, ids, count, picked: calls.append(picked) or order(lm, ids, count, picked))
    fresh = load(tiny_qwen3, backend="cpu")
    one = fresh.choose_skip_layers(0.34)
    two = fresh.choose_skip_layers(0.67)
    assert len(one) == 1 and one < two and fresh.choose_skip_layers(0.34) == one
    assert calls == [(), tuple(one)]
