"""Shared fixtures: tiny random models and the artifacts and exports made from them, each built once per session.

They are read-only: a test that damages or edits one works on a copy (``helpers.copy_dir``); the directory
fixtures check at the end of the session that no file in them changed. Calibrations that test an option
(keep-float, alpha, a recipe) stay in their tests, into ``tmp_path``.

``pytest -m "not slow"`` is the fast subset (memory measurements in subprocesses, the demo model,
whole benchmarks and statistical runs on a real model are ``@pytest.mark.slow``); CI runs everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import FAST_CALIBRATION, tree_digest
from .tiny import save_tiny, save_tiny_qwen2_with_biases, write_naive_artifact


@pytest.fixture(autouse=True, scope="session")
def isolated_cache(tmp_path_factory):
    """What ``load`` derives (ONNX exports of artifacts, made by "auto" on first use) goes to a cache of the session's
    own, never the user's ~/.cache; subprocesses the tests start inherit it. A test that needs an empty cache sets its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUASAR_CACHE", str(tmp_path_factory.mktemp("quasar-cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def float32_by_default():
    """The suite computes float parts in float32 unless a test asks for bf16: which dtype the probe picks depends on the
    CPU kind, and a test's pass or fail must not (tests/test_float_dtype.py covers both dtypes and the choice)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUASAR_FLOAT_DTYPE", "float32")
        yield


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need CUDA; without it they are skipped, saying so (tools/gpu_check.sh runs them on a GPU)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this torch sees none); run tools/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _unchanged(path: Path):
    """Yield ``path``, then fail the session's teardown if a test wrote to it."""
    before = tree_digest(path)
    yield path
    assert tree_digest(path) == before, f"a test modified the shared fixture {path}; copy it first (helpers.copy_dir)"


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    yield from _unchanged(save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    yield from _unchanged(save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen3_tied(tmp_path_factory):
    """tiny_qwen3's shape with the lm_head tied to the embeddings, as Qwen3-0.6B has it."""
    yield from _unchanged(save_tiny(tmp_path_factory.mktemp("tiny-qwen3-tied"), "qwen3", seed=3, tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny Qwen2 with nonzero q/k/v biases (for the npu export's ``bias`` and ``quant_bias``)."""
    yield from _unchanged(save_tiny_qwen2_with_biases(tmp_path_factory.mktemp("tiny-qwen2")))


def _calibrated(model: Path, tmp_path_factory, name: str, **options):
    from quasar_deploy import calibrate

    files = calibrate(model, tmp_path_factory.mktemp(name) / "w8a8", **FAST_CALIBRATION, **options)
    before = tree_digest(files.path)
    yield files
    assert tree_digest(files.path) == before, f"a test modified the shared artifact {files.path}; copy it first (helpers.copy_dir)"


@pytest.fixture(scope="session")
def tiny_artifact(tiny_qwen3, tmp_path_factory):
    """tiny_qwen3 calibrated with dynamic activations (the default recipe, fast settings): a ``ModelFiles``."""
    yield from _calibrated(tiny_qwen3, tmp_path_factory, "tiny-w8a8")


@pytest.fixture(scope="session")
def tiny_static_artifact(tiny_qwen3, tmp_path_factory):
    """tiny_qwen3 calibrated with static (per-tensor, calibrated) activation scales: a ``ModelFiles``."""
    yield from _calibrated(tiny_qwen3, tmp_path_factory, "tiny-w8a8-static", activation="static")


@pytest.fixture(scope="session")
def tiny_int8_head_artifact(tiny_qwen3_tied, tmp_path_factory):
    """tiny_qwen3_tied calibrated with ``int8_lm_head`` (dynamic activations): the head int8, apart from the float embeddings."""
    yield from _calibrated(tiny_qwen3_tied, tmp_path_factory, "tiny-w8a8-int8-head", int8_lm_head=True)


@pytest.fixture(scope="session")
def tiny_qwen2_artifact(tiny_qwen2, tmp_path_factory):
    yield from _calibrated(tiny_qwen2, tmp_path_factory, "tiny-qwen2-w8a8")


@pytest.fixture(scope="session")
def tiny_qwen2_static_artifact(tiny_qwen2, tmp_path_factory):
    yield from _calibrated(tiny_qwen2, tmp_path_factory, "tiny-qwen2-w8a8-static", activation="static")


@pytest.fixture(scope="session")
def naive_artifact(tiny_qwen3, tmp_path_factory):
    """A W8A8 artifact of tiny_qwen3 without calibration (naive weight quantization): enough to load a W8A8 verifier. A path."""
    yield from _unchanged(write_naive_artifact(tiny_qwen3, tmp_path_factory.mktemp("naive") / "w8a8"))


@pytest.fixture(scope="session")
def tiny_onnx(tiny_artifact, tmp_path_factory):
    """tiny_artifact exported to ONNX (W8A8 graph): the export directory."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from quasar_deploy.exporters import export

    yield from _unchanged(export(tiny_artifact.path, "onnx", tmp_path_factory.mktemp("tiny-onnx") / "onnx"))


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and a busy 2-core machine punishes OpenMP spinning."""
    import torch

    torch.set_num_threads(1)
