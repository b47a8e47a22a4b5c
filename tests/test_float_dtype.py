"""The CPU float dtype: bf16 where running the kernel shows it fast, float32 elsewhere; bf16 calls split where the
probe saw a row's bits change with the row count.

The choice is covered on every CPU by monkeypatching the probe; the bf16 numerics run on the real kernels, which
every CPU computes (natively or emulated): bf16 logits close to float32's, every row's bits its own whatever the
row count, speculative output still the verifier's own greedy decode.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from quasar_deploy import doctor
from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends.torch_backend import load_cpu
from quasar_deploy.cli import main
from quasar_deploy.cpu import choice, linears
from quasar_deploy.cpu.linears import FloatProbe, default_float_dtype
from quasar_deploy.errors import QuasarError
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams
from quasar_deploy.speculative.ngram import NgramDrafter

from .helpers import greedy, skip_without_bf16, speculate

PROMPT = [7, 100, 7, 100, 7, 55, 9, 7, 100, 7]
# bf16 keeps 8 significant bits: each rounding is within 2^-9 relative. Over the tiny models' 2 layers the logits of
# the bf16 model move by a few per cent of their largest value; 5% bounds that with room, and is far below what a
# wrong computation (a transposed weight, a missing norm) gives.
BF16_LOGIT_RTOL = 0.05


@pytest.fixture(autouse=True)
def fresh_probe():
    linears.float_probe.cache_clear()
    yield
    linears.float_probe.cache_clear()


def probe_says(monkeypatch, probe: FloatProbe) -> None:
    monkeypatch.delenv(linears.FLOAT_DTYPE_ENV, raising=False)
    monkeypatch.setattr(linears, "float_probe", lambda: probe)


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        (FloatProbe(4.0, 1.5, 256), torch.bfloat16),  # native bf16: 2.7x
        (FloatProbe(4.0, 1.5, 32), torch.bfloat16),  # native, its calls split over 32 rows: the timing already paid it
        (FloatProbe(4.0, 3.5, 256), torch.float32),  # barely faster: not worth the precision
        (FloatProbe(4.0, 20.0, 256), torch.float32),  # emulated: far slower
    ],
    ids=["native", "native-split", "marginal", "emulated"],
)
def test_the_probe_decides_the_cpu_float_dtype(monkeypatch, probe, expected):
    probe_says(monkeypatch, probe)
    assert default_float_dtype("cpu") == expected
    assert default_float_dtype("cuda") == torch.bfloat16
    assert "bf16" in probe.reason


def test_a_named_dtype_or_the_environment_overrides_the_probe(monkeypatch):
    probe_says(monkeypatch, FloatProbe(4.0, 1.5, 256))
    assert default_float_dtype("cpu", "float32") == torch.float32
    monkeypatch.setenv(linears.FLOAT_DTYPE_ENV, "float32")
    assert default_float_dtype("cpu") == torch.float32
    with pytest.raises(QuasarError, match="unknown float dtype 'fp8'"):
        default_float_dtype("cpu", "fp8")


BF16_REFUSAL = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"


def refuse_bf16_packing(monkeypatch) -> None:
    """oneDNN as torch gives it on a CPU without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: packing a bf16 weight raises."""
    real = linears._onednn_linear

    def packing(weight, bias, most_rows=None):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(BF16_REFUSAL + "\n(torch's trace)")
        return real(weight, bias, most_rows)

    monkeypatch.setattr(linears, "_onednn_linear", packing)


def test_a_cpu_whose_onednn_refuses_bf16_computes_float32_and_says_why(monkeypatch):
    """An AVX2-only CPU: torch refuses oneDNN's bf16 linear there. The probe must not fail with it (every float path
    asks it); it times float32 alone and reports the refusal's first line."""
    if not linears.onednn_available():
        pytest.skip("the refusal is oneDNN's; this torch has no oneDNN")
    monkeypatch.delenv(linears.FLOAT_DTYPE_ENV, raising=False)
    refuse_bf16_packing(monkeypatch)
    probe = linears.float_probe()
    assert probe.dtype == torch.float32 and default_float_dtype("cpu") == torch.float32
    assert probe.float32_ms > 0 and probe.bfloat16_ms is None and probe.bf16_missing == BF16_REFUSAL
    assert probe.reason == f"no bf16 linear here: {BF16_REFUSAL}" and probe.rows_text is None
    assert default_float_dtype("cuda") == torch.bfloat16
    assert default_float_dtype("cpu", "float32") == torch.float32
    with pytest.raises(QuasarError, match=r"^bfloat16 cannot compute on this CPU \(mkldnn_reorder.*avx512dq\): use float32$"):
        default_float_dtype("cpu", "bfloat16")
    monkeypatch.setenv(linears.FLOAT_DTYPE_ENV, "bfloat16")
    with pytest.raises(QuasarError, match="^bfloat16 cannot compute on this CPU"):
        default_float_dtype("cpu")


def test_doctor_reports_a_cpu_without_bf16(monkeypatch):
    probe = FloatProbe(0.5, None, 0, BF16_REFUSAL)
    probe_says(monkeypatch, probe)
    monkeypatch.setattr(doctor, "float_probe", lambda: probe)
    found = doctor.probes()
    assert found["float_dtype"] == "float32" and found["bfloat16_ms"] is None and found["bf16_rows"] is None
    assert found["float_dtype_why"] == f"no bf16 linear here: {BF16_REFUSAL}"
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("float dtype"))
    assert line.endswith(f"(float models wholly, W8A8 models' lm_head; no bf16 linear here: {BF16_REFUSAL})")


def test_the_probe_finds_the_row_count_where_a_kernel_changes_its_rounding():
    """A kernel that rounds otherwise from 33 rows on (as oneDNN's bf16 one does on some CPUs) is found at 32; one that
    never does, at the largest count checked; one that differs at 2 rows, at 1 (every call then split to rows)."""

    def rounding_from(count):
        def linear(x):
            y = x.float().sum(-1, keepdim=True).repeat(1, 3)
            return y + 1e-3 if x.shape[0] >= count else y

        return linear

    x = torch.randn(linears.BF16_ROW_COUNTS[-1], 8)
    assert linears._bf16_invariant_rows(rounding_from(33), x) == 32
    assert linears._bf16_invariant_rows(rounding_from(10**6), x) == linears.BF16_ROW_COUNTS[-1]
    assert linears._bf16_invariant_rows(rounding_from(2), x) == 1
    assert "larger calls are split" in FloatProbe(4.0, 1.5, 32).rows_text
    assert "every count checked" in FloatProbe(4.0, 1.5, 256).rows_text


@pytest.mark.parametrize("most_rows", [1, 5, 32])
def test_a_bf16_linear_splits_its_calls_at_the_probes_row_count(monkeypatch, most_rows):
    if not linears.onednn_available():
        pytest.skip("the split lives in oneDNN's packed linear; this torch has no oneDNN")
    skip_without_bf16()
    probe_says(monkeypatch, FloatProbe(4.0, 1.5, most_rows))
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(x.shape[0]) or real(x, *a), raising=False)
    linear = linears.float_linear(torch.randn(16, 8).bfloat16(), None, "onednn")
    x = torch.randn(70, 8).bfloat16()
    y = linear(x)
    assert y.shape == (70, 16) and max(calls) <= max(most_rows, 2)  # a single row goes as two (oneDNN's M = 1 path)
    assert torch.equal(y, torch.cat([linear(row) for row in x.split(1)]))


def test_the_real_probe_measures_both_dtypes_and_bf16_rows_are_their_own_at_every_count():
    """What every CPU guarantees after the probe: whatever count a bf16 call takes, each row gets its bits alone."""
    probe = linears.float_probe()
    if not linears.onednn_available():
        pytest.skip("no oneDNN in this torch: the product computes float32 with torch's kernel")
    if probe.bf16_missing:
        pytest.skip(f"oneDNN has no bf16 linear on this CPU ({probe.bf16_missing}): the product computes float32")
    assert probe.float32_ms > 0 and probe.bfloat16_ms > 0 and probe.bf16_invariant_rows >= 1
    assert probe.dtype in (torch.float32, torch.bfloat16)
    torch.manual_seed(0)
    linear = linears.float_linear(torch.randn(512, 2048).bfloat16(), None, "onednn")
    x = torch.randn(300, 2048).bfloat16()
    alone = torch.cat([linear(row) for row in x.split(1)])
    for count in (2, 6, 32, 33, 48, 64, 256, 300):
        assert torch.equal(linear(x[:count]), alone[:count]), count


def test_the_int8_probe_tells_a_saturating_kernel_from_an_exact_one():
    """What decides fbgemm-vnni and onednn-vnni: a kernel that sums pairs in saturating 16 bits fails the probe."""

    def saturating(wq, w_scale):
        def run(x):
            from quasar_deploy.scheme import per_token_scale, quantize_activation

            q = quantize_activation(x, per_token_scale(x)) + 128  # u8 codes, as FBGEMM's AVX2 kernel gets them
            pairs = (q[:, None, :] * wq.float()[None]).reshape(x.shape[0], wq.shape[0], -1, 2).sum(-1)
            acc = pairs.clamp(-32768, 32767).sum(-1) - 128 * wq.float().sum(-1)
            return acc * per_token_scale(x) * w_scale.reshape(1, -1)

        return run

    def failing(wq, w_scale):
        raise RuntimeError("no kernel for this CPU")

    assert not linears._sums_bit_exact(saturating)
    assert not linears._sums_bit_exact(failing)
    assert linears._sums_bit_exact(lambda wq, w_scale: linears._reference(wq, w_scale, None, None))


def test_the_default_int8_kernel_follows_the_probes(monkeypatch):
    monkeypatch.setattr(linears, "fbgemm_available", lambda: True)
    for timed, chosen in (
        ({"fbgemm-vnni": 2.0, "onednn-vnni": 1.0}, "onednn-vnni"),
        ({"fbgemm-vnni": 1.0, "onednn-vnni": 2.0}, "fbgemm-vnni"),
        ({"fbgemm-vnni": 0.0}, "fbgemm-vnni"),  # the only exact kernel: not timed
        ({"quasar": 2.0, "fbgemm": 1.0}, "fbgemm"),  # an AVX2 CPU where FBGEMM's split kernel timed faster than ours
        ({"quasar": 1.0, "fbgemm": 2.0}, "quasar"),
        ({}, "reference"),  # no FBGEMM and no build of ours
    ):
        monkeypatch.setattr(choice, "int8_probe", lambda timed=timed: choice.Int8Probe(timed))
        assert choice.default_int8_kernel("cpu") == chosen
        assert choice.default_int8_kernel("cuda") == "reference"
    assert "onednn-vnni 1.00 ms" in choice.Int8Probe({"fbgemm-vnni": 2.0, "onednn-vnni": 1.0}).reason
    assert "but the reference" in choice.Int8Probe({}).reason
    monkeypatch.setattr(linears, "vnni_available", lambda: False)
    with pytest.raises(QuasarError, match="fbgemm-vnni kernel needs"):
        linears.check_int8_kernel("fbgemm-vnni")


@pytest.mark.parametrize("fbgemm, onednn, ours", [(True, False, False), (False, True, False), (False, False, True), (False, False, False)])
def test_the_int8_probe_times_only_when_two_kernels_are_exact(monkeypatch, fbgemm, onednn, ours):
    monkeypatch.setattr(linears, "fbgemm_available", lambda: fbgemm)  # without it, no split kernel to time either
    monkeypatch.setattr(linears, "vnni_available", lambda: fbgemm)
    monkeypatch.setattr(linears, "onednn_int8_bit_exact", lambda: onednn)
    monkeypatch.setattr(linears, "quasar_int8_available", lambda: ours)
    monkeypatch.setattr(choice, "onnxruntime_int8_bit_exact", lambda: False)  # ORT beside them: tests/test_cpu_int8.py
    choice.int8_probe.cache_clear()
    try:
        probe = choice.int8_probe()
    finally:
        choice.int8_probe.cache_clear()  # the next caller probes this CPU itself
    expected = [name for name, exact in (("fbgemm-vnni", fbgemm), ("onednn-vnni", onednn), ("quasar", ours)) if exact]
    assert list(probe.ms) == expected and all(ms == 0.0 for ms in probe.ms.values())


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3", "tiny_qwen3_tied"])
def test_a_bf16_float_model_stays_close_to_float32_and_holds_no_float32_weight(request, checkpoint):
    skip_without_bf16()
    files = open_model_files(request.getfixturevalue(checkpoint))
    lm32, lm16 = load_cpu(files, float_dtype="float32"), load_cpu(files, float_dtype="bfloat16")
    assert lm16.description.startswith("cpu float, ") and "float dtype bfloat16" in lm16.description
    floats = {p.dtype for p in lm16.decoder.parameters() if p.dtype.is_floating_point}
    assert floats == {torch.bfloat16}
    expected, got = lm32.verify(PROMPT), lm16.verify(PROMPT)
    assert (got - expected).abs().max() < BF16_LOGIT_RTOL * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_a_w8a8_model_computes_its_head_in_bf16(tiny_artifact):
    skip_without_bf16()
    lm32 = load_cpu(tiny_artifact, float_dtype="float32")
    lm16 = load_cpu(tiny_artifact, float_dtype="bfloat16")
    assert lm16.decoder.lm_head.dtype == torch.bfloat16 and lm16.decoder.dtype == torch.float32
    expected, got = lm32.verify(PROMPT), lm16.verify(PROMPT)
    assert got.dtype == torch.float32
    assert 0 < (got - expected).abs().max() < BF16_LOGIT_RTOL * expected.abs().max()


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3", "tiny_artifact"])
def test_bf16_speculative_output_is_the_verifiers_own_greedy_decode(request, checkpoint):
    skip_without_bf16()
    model = request.getfixturevalue(checkpoint)
    lm = load_cpu(open_model_files(getattr(model, "path", model)), float_dtype="bfloat16")
    expected = greedy(lm, PROMPT, 24)
    for k in (1, 3, 6):
        steps = speculate(lm, NgramDrafter(), PROMPT, Sampler(SamplingParams()), k, 24)
        assert [t for step in steps for t in step] == expected


def test_a_head_in_another_dtype_converts_its_input():
    """A bf16 head inside a float32 decoder: input converted in, output handed back in the caller's dtype."""
    from quasar_deploy.model import Linear

    skip_without_bf16()
    weight = torch.randn(64, 32)
    head = Linear(weight.bfloat16(), dtype=torch.bfloat16)
    head.prepare("onednn" if linears.onednn_available() else "torch")
    x = torch.randn(3, 32)
    y = head(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y, x @ weight.t(), rtol=0.05, atol=0.05)
