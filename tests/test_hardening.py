"""Hostile and careless inputs: each is refused before any work, in one line naming the cause (regression table)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quasar_deploy.artifact import open_model_files
from quasar_deploy.cli import main
from quasar_deploy.errors import QuasarError


def _copy(source, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DELETE:
            config.pop(key)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


_DELETE = object()

BAD_CONFIGS = [
    (dict(num_hidden_layers=2), "num_hidden_layers is 2 but the weights hold 3 layers"),
    (dict(num_hidden_layers=5), "num_hidden_layers is 5 but the weights hold 3 layers"),
    (dict(vocab_size=4000), "config.json (vocab_size) implies [4000, 64]"),
    (dict(hidden_size="abc"), "hidden_size must be an integer, not 'abc'"),
    (dict(hidden_size=_DELETE), "hidden_size is missing"),
    (dict(num_attention_heads=0), "num_attention_heads must be >= 1"),
    (dict(num_attention_heads=3), "must be a multiple of num_key_value_heads"),
    (dict(intermediate_size=161), "config.json (its shape fields) implies"),
    (dict(rope_theta=0), "rope_theta must be a positive finite number"),
    (dict(rope_theta=-5.0), "rope_theta must be a positive finite number"),
    (dict(rope_theta="big"), "rope_theta must be a finite number"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be > 0"),
    (dict(rope_scaling=[1, 2]), "rope_parameters and rope_scaling must be JSON objects"),
    (dict(max_position_embeddings=True), "max_position_embeddings must be an integer"),
]


@pytest.mark.parametrize("changes, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_a_config_that_disagrees_with_its_weights_is_refused(tiny_qwen3, tmp_path, changes, message):
    model = _copy(tiny_qwen3, tmp_path)
    _edit_config(model, **changes)
    with pytest.raises(QuasarError, match="config.json") as error:
        open_model_files(model)
    assert message in str(error.value)
    result = CliRunner().invoke(main, ["calibrate", str(model), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output and message in result.output
    assert not (tmp_path / "out").exists()


def test_a_config_that_is_not_an_object_is_refused(tiny_qwen3, tmp_path):
    model = _copy(tiny_qwen3, tmp_path)
    (model / "config.json").write_text("[]")
    with pytest.raises(QuasarError, match="expected a JSON object, not list"):
        open_model_files(model)


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


BAD_TENSORS = [
    ("nan weight", lambda t: t["model.layers.1.mlp.up_proj.weight"].__setitem__((0, 0), float("nan")), "NaN or infinite"),
    ("inf norm", lambda t: t["model.norm.weight"].__setitem__(3, float("inf")), "NaN or infinite"),
    (
        "transposed weight",
        lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight", t["model.layers.0.mlp.down_proj.weight"].t().contiguous()),
        "has shape [160, 64]",
    ),
]


@pytest.mark.parametrize("name, edit, message", BAD_TENSORS, ids=[n for n, _, _ in BAD_TENSORS])
def test_bad_float_tensors_are_refused_at_load(tiny_qwen3, tmp_path, name, edit, message):
    model = _copy(tiny_qwen3, tmp_path)
    _edit_tensors(model, edit)
    with pytest.raises(QuasarError) as error:
        open_model_files(model).decoder()
    assert message in str(error.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_weight_scales_are_refused_at_load(value):
    from quasar_deploy.model import check_finite

    scale = torch.full((8, 1), 0.01)
    scale[3] = value
    with pytest.raises(QuasarError, match="model.layers.0.mlp.up_proj.weight_scale"):
        check_finite("model.layers.0.mlp.up_proj.weight_scale", scale)
    check_finite("model.layers.0.mlp.up_proj.weight_scale", torch.full((8, 1), 0.01))


def test_a_missing_tokenizer_is_named(tiny_qwen3, tmp_path):
    model = _copy(tiny_qwen3, tmp_path)
    (model / "tokenizer.json").unlink()
    result = CliRunner().invoke(main, ["generate", str(model), "--prompt", "def f():"])
    assert result.exit_code == 1 and "no tokenizer" in result.output and "Traceback" not in result.output


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tiny_qwen3, tmp_path):
    model = _copy(tiny_qwen3, tmp_path)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append(
        {"id": 5000, "content": "<extra>", "special": True, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    )
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = CliRunner().invoke(main, ["generate", str(model), "--prompt", "def f():"])
    assert result.exit_code == 1 and "but the model's vocabulary is 4096" in result.output and "Traceback" not in result.output


# --- the engine: concurrency, prompts, seeds, templates, numerics ---

PROMPTS = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def push(self, x):\n", "import os\n\nfor name in", "x = [1, 2, 3]\n"]


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    from quasar_deploy.api import load

    return load(tiny_qwen3, backend="cpu")


def test_threads_sharing_an_engine_get_the_sequential_results(engine):
    import threading

    expected = [engine.generate(p, max_new_tokens=12).tokens for p in PROMPTS]
    got: dict[tuple[int, int], list[int]] = {}
    failures: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i, prompt in enumerate(PROMPTS):
                got[t, i] = engine.generate(prompt, max_new_tokens=12, draft="ngram" if t % 2 else "none").tokens
        except BaseException as exc:  # collected and re-raised by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert all(got[t, i] == expected[i] for t in range(4) for i in range(len(PROMPTS)))


def test_a_paused_stream_is_never_corrupted_by_another_generation(engine):
    expected = engine.generate(PROMPTS[0], max_new_tokens=20).text
    stream = engine.stream(PROMPTS[0], max_new_tokens=20)
    first = next(stream)
    with pytest.raises(QuasarError, match="unfinished stream in this thread"):
        engine.generate(PROMPTS[1], max_new_tokens=5)
    assert first + "".join(stream) == expected
    assert engine.generate(PROMPTS[1], max_new_tokens=5).tokens  # the lock is free again


@pytest.mark.parametrize(
    "prompt, options, message",
    [
        (b"def f():", {}, "the prompt is bytes"),
        ("def f():\udcff", {}, "not valid UTF-8 text"),
        ([{"role": "user", "content": "hi \ud800"}], {}, "not valid UTF-8 text"),
        ("def f():", {"seed": 2**70}, "seed must be an integer in [0, 2**64 - 1]"),
        ("def f():", {"seed": -1}, "seed must be an integer in [0, 2**64 - 1]"),
    ],
)
def test_bad_prompts_and_seeds_are_one_line_errors(engine, prompt, options, message):
    with pytest.raises(QuasarError) as error:
        engine.generate(prompt, max_new_tokens=2, **options)
    assert message in str(error.value)


def test_cli_refuses_an_undecodable_prompt_and_a_huge_seed(tiny_qwen3):
    runner = CliRunner()
    bad = runner.invoke(main, ["generate", str(tiny_qwen3), "--prompt", "def f():\udcff"])
    assert bad.exit_code == 1 and "not valid UTF-8 text" in bad.output and "Traceback" not in bad.output
    seed = runner.invoke(main, ["generate", str(tiny_qwen3), "--prompt", "x", "--seed", str(2**70)])
    assert seed.exit_code == 2 and "Invalid value for '--seed'" in seed.output


def test_non_finite_logits_stop_generation_with_an_error(engine):
    from quasar_deploy.engine import Engine

    class Broken:
        vocab_size, max_length, length = engine.lm.vocab_size, 64, 0

        def prefill(self, ids):
            return torch.full((self.vocab_size,), float("nan"))

    with pytest.raises(QuasarError, match="non-finite logit"):
        Engine(Broken(), engine.tokenizer).generate("def f():", max_new_tokens=3, draft="none")


def test_calibration_refuses_overflowing_statistics(tiny_qwen3, tmp_path):
    from quasar_deploy import calibrate

    model = _copy(tiny_qwen3, tmp_path)
    _edit_tensors(model, lambda t: t["model.layers.0.post_attention_layernorm.weight"].fill_(1e30))
    with pytest.raises(QuasarError, match=r"model.layers.0.mlp.down_proj: its calibration inputs hold NaN or infinity"):
        calibrate(model, tmp_path / "out", num_samples=2, seq_len=16, progress=False)
    assert not (tmp_path / "out").exists()


def test_unusable_outputs_are_refused_before_any_work(tiny_qwen3, tmp_path):
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    result = CliRunner().invoke(main, ["calibrate", str(tiny_qwen3), "-o", str(dangling)])
    assert result.exit_code == 1 and "dangling symbolic link" in result.output
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(main, ["calibrate", str(tiny_qwen3), "-o", str(blocker / "out")])
    assert result.exit_code == 1 and "is not a writable directory" in result.output
