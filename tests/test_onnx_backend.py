"""The onnxruntime backend: greedy decoding and verify-after-truncate agree with ORT's own run and with torch."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from quasar_deploy.backends import BACKENDS  # noqa: E402
from quasar_deploy.backends.onnxruntime import choose_providers, load_onnx_export  # noqa: E402
from quasar_deploy.backends.ort_session import unavailable  # noqa: E402
from quasar_deploy.backends.registry import create_export_backend  # noqa: E402
from quasar_deploy.backends.torch_backend import load_cpu  # noqa: E402
from quasar_deploy.errors import QuasarError  # noqa: E402

from .helpers import ONNX_PROMPT as PROMPT  # noqa: E402
from .helpers import (  # noqa: E402
    copy_dir,
    greedy,
    reseal,  # noqa: E402
    run_full,
)
from .helpers import ort_session as session  # noqa: E402


@pytest.fixture
def artifact_and_onnx(tiny_artifact, tiny_onnx):
    return tiny_artifact, tiny_onnx


def test_greedy_decoding_matches_ort_and_torch(artifact_and_onnx):
    artifact, out = artifact_and_onnx
    lm = load_onnx_export(out, threads=1)
    assert isinstance(lm.prefill([1]), torch.Tensor) and lm.vocab_size == 4096 and lm.max_length == 512
    tokens = greedy(lm, PROMPT, 20)
    assert lm.length == len(PROMPT) + 19  # the last token is pending
    lm.verify(tokens[-1:])
    assert lm.length == len(PROMPT) + 20
    # ORT's own answer: recompute the whole sequence at every step, no cache
    sess, spec, ort_tokens = session(out / "model.onnx"), artifact.spec, []
    for _ in range(20):
        ort_tokens.append(int(run_full(sess, spec, PROMPT + ort_tokens)[-1].argmax()))
    assert tokens == ort_tokens
    # the torch decoder with the exact reference int8 kernel
    assert tokens == greedy(load_cpu(artifact, int8_kernel="reference"), PROMPT, 20)


def test_verify_after_truncate_matches_torch(artifact_and_onnx):
    artifact, out = artifact_and_onnx
    lm = create_export_backend("onnxruntime", out, threads=1)
    reference = load_cpu(artifact, int8_kernel="reference")
    draft = [17, 300, 300, 9, 2]
    for backend in (lm, reference):
        backend.prefill(PROMPT)
        backend.verify([4, 4, 4, 4])  # a rejected draft...
        backend.truncate(len(PROMPT) + 1)  # ...keeping its first token
        backend.verify(draft)
    assert lm.length == reference.length == len(PROMPT) + 1 + len(draft)
    lm.truncate(len(PROMPT) + 1)
    reference.truncate(len(PROMPT) + 1)
    got, expected = lm.verify(draft), reference.verify(draft)
    assert got.shape == (len(draft), 4096)
    assert (got - expected).abs().max().item() < 1e-4 and torch.equal(got.argmax(-1), expected.argmax(-1))
    with pytest.raises(ValueError):
        lm.truncate(lm.length + 1)


def test_speculative_engine_on_onnxruntime_matches_cpu(artifact_and_onnx):
    """The n-gram speculative loop (verify blocks, rollbacks) gives the cpu backend's tokens."""
    from quasar_deploy.api import load

    artifact, out = artifact_and_onnx
    prompt = "the cat sat on the mat. the cat sat on the"
    got = load(out, backend="onnxruntime", threads=1).generate(prompt, max_new_tokens=16, draft="ngram")
    expected = load(artifact.path, backend="cpu", int8_kernel="reference").generate(prompt, max_new_tokens=16, draft="ngram")
    assert got.tokens == expected.tokens and len(got.tokens) > 0


def test_new_sequences_share_the_session_and_interleave(tiny_onnx):
    """Two sequences over one ORT session, stepped in turn, each give the tokens they give alone."""
    lm = load_onnx_export(tiny_onnx, threads=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    alone = [greedy(lm, p, 6) for p in prompts]
    first, second = lm.new_sequence(), lm.new_sequence()
    assert first.session is lm.session and first.length == 0
    logits = [first.prefill(prompts[0]), second.prefill(prompts[1])]
    tokens: list[list[int]] = [[], []]
    for _ in range(6):
        for i, seq in enumerate((first, second)):
            tokens[i].append(int(logits[i].argmax()))
            logits[i] = seq.verify(tokens[i][-1:])[-1]
    assert tokens == alone


def test_registered_and_available(tiny_onnx):
    assert "onnxruntime" in BACKENDS and unavailable() is None
    lm, direct = create_export_backend("onnxruntime", tiny_onnx, threads=1), load_onnx_export(tiny_onnx, threads=1)  # its export factory
    assert type(lm) is type(direct) and torch.equal(lm.prefill(PROMPT), direct.prefill(PROMPT))


def test_missing_provider_is_one_line_error():
    with pytest.raises(QuasarError, match="CUDAExecutionProvider is not available") as info:
        choose_providers("cuda", ["CPUExecutionProvider"])
    assert "\n" not in str(info.value)
    assert choose_providers(None, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers("auto", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with pytest.raises(QuasarError, match="unknown execution provider"):
        choose_providers("npu", ["CPUExecutionProvider"])


def corrupt_graph(d):
    data = (d / "model.onnx").read_bytes()
    (d / "model.onnx").write_bytes(data[: len(data) // 3])


def fewer_layers(d):
    config = json.loads((d / "genai_config.json").read_text())
    config["model"]["decoder"]["num_hidden_layers"] = 2
    (d / "genai_config.json").write_text(json.dumps(config))


def other_vocabulary(d):
    config = json.loads((d / "genai_config.json").read_text())
    config["model"]["vocab_size"] = 32000
    (d / "genai_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (corrupt_graph, "ONNX Runtime cannot load the graph"),
        (lambda d: (d / "genai_config.json").unlink(), "no genai_config.json"),
        (lambda d: (d / "genai_config.json").write_text("{"), "not a valid ONNX export description"),
        (lambda d: (d / "model.onnx").unlink(), "'model.onnx' is missing"),
        (fewer_layers, "does not match genai_config.json"),
        (other_vocabulary, "does not match genai_config.json"),
    ],
)
def test_damaged_directory_is_one_line_error(artifact_and_onnx, tmp_path, damage, message):
    copy = copy_dir(artifact_and_onnx[1], tmp_path)
    damage(copy)
    reseal(copy, "quasar-export.json")  # the export manifest refuses each of these first; reach the checks behind it
    with pytest.raises(QuasarError, match=message) as info:
        load_onnx_export(copy, threads=1)
    assert "\n" not in str(info.value)


def test_cli_export(artifact_and_onnx, tmp_path):
    from click.testing import CliRunner

    from quasar_deploy.cli import main

    result = CliRunner().invoke(main, ["export", str(artifact_and_onnx[0].path), "--target", "onnx", "--output", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cli" / "model.onnx").is_file()


@pytest.mark.parametrize(("policy", "spinning"), [(None, "1"), ("PASSIVE", "0"), ("active", "1")])
def test_ort_threads_spin_unless_openmp_waits_are_passive(tiny_onnx, monkeypatch, policy, spinning):
    from quasar_deploy.backends.onnxruntime import load_onnx_export
    from quasar_deploy.backends.ort_session import SPINNING_OPTION

    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    lm = load_onnx_export(tiny_onnx)
    assert lm.session.get_session_options().get_session_config_entry(SPINNING_OPTION) == spinning


def test_int8_options_are_the_fastest_exact_ones(monkeypatch):
    """No option where u8 x s8 is exact as is (VNNI); the u8 x u8 re-encoding where only it is; an error where neither."""
    from quasar_deploy.backends import ort_session as backend

    def probe_with(exact_under):
        backend.bit_exact_int8_entries.cache_clear()
        monkeypatch.setattr(backend, "_int8_sums_bit_exact", lambda entries: entries in exact_under)
        return backend.bit_exact_int8_entries()

    try:
        assert probe_with([(), (backend.PRECISE_INT8_OPTION,)]) == ()
        assert probe_with([(backend.PRECISE_INT8_OPTION,)]) == (backend.PRECISE_INT8_OPTION,)
        with pytest.raises(QuasarError, match="not bit-exact on this CPU"):
            probe_with([])
    finally:
        backend.bit_exact_int8_entries.cache_clear()


def test_int8_probe_agrees_with_this_cpu():
    """The precise option always gives exact sums; without it the probe's verdict matches whether this CPU has VNNI."""
    from quasar_deploy.backends import ort_session as backend
    from quasar_deploy.cpu.machine import cpu_flags

    assert backend._int8_sums_bit_exact((backend.PRECISE_INT8_OPTION,))
    if "avx512_vnni" in cpu_flags():
        assert backend._int8_sums_bit_exact(())


def test_decoder_sessions_plan_no_memory_per_shape(tiny_onnx, tiny_artifact):
    """ORT's memory pattern traces every new set of input shapes on its first run: a decoder meets a new past length at
    every step, so the first generation after load paid a trace per step that later ones of the same lengths did not."""
    from quasar_deploy.backends.onnx_layered import load_layered
    from quasar_deploy.backends.onnxruntime import load_onnx_export
    from quasar_deploy.backends.ort_session import session_options

    assert not load_onnx_export(tiny_onnx).session.get_session_options().enable_mem_pattern
    layered = load_layered(tiny_artifact, threads=1, progress=False).model
    sessions = [*layered.inputs, *layered.outputs, layered.final_norm]
    assert sessions and not any(s.get_session_options().enable_mem_pattern for s in sessions)
    assert session_options(1, fixed_shape=True).enable_mem_pattern  # the int8 probe runs one shape: its plan pays
