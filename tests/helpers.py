"""What several test modules do: greedy decoding over a ``CausalLM``, ONNX Runtime sessions, copies to damage, one-line errors,
a Markov ``CausalLM`` with known distributions and the chi-square test sampled output is checked with.

Test modules import from here (and model builders from tiny.py), never from each other.
onnx and onnxruntime are imported inside the functions that need them, so importing this module needs neither.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

# The calibration settings of the shared artifacts (conftest.py), and of the tests that calibrate a variant.
FAST_CALIBRATION = dict(num_samples=8, seq_len=64, progress=False)

# Token ids for the ONNX tests (any ids below the tiny vocabulary of 4096 would do).
ONNX_PROMPT = [1, 5, 9, 200, 33, 7, 8, 4000, 12]


def skip_without_bf16() -> None:
    """Skips a test of bf16 computing on a CPU whose oneDNN has no bf16 linear (AVX2 only, no AVX-512 BW/VL/DQ nor
    AVX-NE-CONVERT): the product computes float32 there and refuses bf16 in one line (test_float_dtype.py)."""
    from quasar_deploy.cpu.linears import float_probe

    if missing := float_probe().bf16_missing:
        pytest.skip(f"no bf16 linear on this CPU: {missing}")


def greedy(lm, prompt: list[int], n: int) -> list[int]:
    """The verifier decoding on its own: prefill, then one token per forward, up to ``n`` tokens or the context window.

    The last token stays pending (not fed back), as in the speculative loop: afterwards ``lm.length == len(prompt) + n - 1``.
    """
    out: list[int] = []
    logits = lm.prefill(prompt)
    while True:
        out.append(int(logits.argmax()))
        if len(out) >= n or len(prompt) + len(out) >= lm.max_length:
            return out
        logits = lm.verify([out[-1]])[-1]


def ort_session(model_or_path, optimized: Path | None = None):
    """A single-threaded CPU ONNX Runtime session for a model file or an in-memory ``onnx.ModelProto``."""
    import onnx
    import onnxruntime as ort

    from quasar_deploy.backends.ort_session import session_options

    options = session_options(1)  # as the backend's: exact u8 x s8 on every x64 CPU
    if optimized:
        options.optimized_model_filepath = str(optimized)
    source = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def prefill_feed(spec, ids: list[int]) -> dict:
    """A whole-decoder graph's inputs for ``ids`` in one call with an empty cache."""
    import numpy as np

    n = len(ids)
    feed = {"input_ids": np.array([ids], np.int64), "position_ids": np.arange(n)[None], "attention_mask": np.ones((1, n), np.int64)}
    empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
    for i in range(spec.num_layers):
        feed[f"past_key_values.{i}.key"] = feed[f"past_key_values.{i}.value"] = empty
    return feed


def run_full(sess, spec, ids: list[int]):
    """No cache: the whole sequence in one call (ORT's own answer, independent of the backend's cache handling)."""
    return sess.run(["logits"], prefill_feed(spec, ids))[0][0]


def copy_dir(source: Path, tmp_path: Path, name: str = "copy") -> Path:
    """A private copy of a shared model, artifact or export, for a test that damages or edits it."""
    return Path(shutil.copytree(source, tmp_path / name))


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, by relative name: compared before and after to prove a shared fixture was not touched."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def output_lines(result) -> list[str]:
    """The non-blank lines a click ``CliRunner`` result printed (stdout and stderr)."""
    return [line for line in result.output.splitlines() if line.strip()]


def assert_one_line_error(result, text: str, *, only_line: bool = False) -> None:
    """Exit code 1, no traceback, and the last printed line (``only_line``: the only one) is ``error: ...`` naming ``text``."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = output_lines(result)
    if only_line:
        assert len(lines) == 1, result.output
    assert lines[-1].startswith("error: ") and text in lines[-1], result.output


def reseal(directory: Path, manifest: str = "quasar.json") -> None:
    """Rewrite the manifest's checksums after an edit, as a careful attacker would, to reach the checks behind them."""
    from quasar_deploy.integrity import write_manifest

    record = json.loads((directory / manifest).read_text())
    record.pop("files")
    write_manifest(directory, manifest, record)


class MarkovLM:
    """A CausalLM whose next-token logits depend only on the last token: exact distributions are known."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.vocab_size = table.shape[0]
        self.max_length = 1000
        self.ids: list[int] = []

    def prefill(self, ids):
        self.ids = list(ids)
        return self.table[self.ids[-1]]

    def verify(self, ids):
        self.ids += list(ids)
        return self.table[list(ids)]

    def truncate(self, length):
        del self.ids[length:]

    @property
    def length(self):
        return len(self.ids)


def chi_square_p_value(observed: Counter, expected: dict) -> float:
    """p-value of observed counts against expected probabilities; cells expected below 5 are pooled."""
    n = sum(observed.values())
    if any(cell not in expected or expected[cell] == 0 for cell in observed):
        return 0.0
    obs, exp, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for cell, prob in expected.items():
        if prob * n >= 5:
            obs.append(observed[cell])
            exp.append(prob * n)
        else:
            pooled_obs += observed[cell]
            pooled_exp += prob * n
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    obs_t, exp_t = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


def speculate(*args, **kwargs):
    """``Speculation(*args, **kwargs).steps()``: the new tokens of each verify step of one sequence."""
    from quasar_deploy.speculative.loop import Speculation

    return Speculation(*args, **kwargs).steps()


def _copy_of(array):
    def fill(out):
        out[...] = array

    return fill


def decoder_graph(decoder, name: str, linear_format: str = "integer"):
    """The whole decoder held in memory (float32 compute) as one ONNX model with KV-cache inputs and outputs; W8A8
    linears in ``linear_format``."""
    from quasar_deploy.exporters.onnx_graph import GraphBuilder, build_graph

    embed = decoder.model.embed_tokens.weight.float().numpy()
    head = None
    if decoder.lm_head.quantized:
        head = decoder.lm_head
    elif not decoder.spec.tie_word_embeddings:
        head = _copy_of(decoder.lm_head.weight.float().numpy().T)
    g = GraphBuilder(linear_format)
    return build_graph(
        g,
        decoder.spec,
        name,
        decoder.inv_freq,
        _copy_of(embed),
        decoder.model.layers,
        decoder.model.norm,
        head,
    )
