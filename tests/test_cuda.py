"""The cuda backend. Its code path runs on the CPU here (``torch._int_mm`` exists there too, the device is a parameter);
what needs a GPU (the Triton kernel, CUDA graphs, agreement with the CPU reference on a GPU) is ``@pytest.mark.gpu``,
skipped without CUDA and run by tools/gpu_check.sh."""

from __future__ import annotations

import random

import pytest
import torch

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import cuda as cuda_backend
from quasar_deploy.backends.cuda_linear import CPU_RULES, CUDA_RULES, Int8Linear, IntMMRules, quantize_rows_torch
from quasar_deploy.backends.registry import BACKENDS, auto_backend, create_backend
from quasar_deploy.backends.static_decode import SPAN, StaticCache
from quasar_deploy.backends.torch_backend import TorchCausalLM
from quasar_deploy.errors import QuasarError
from quasar_deploy.scheme import per_token_scale, quantize_activation, quantize_weight, reference_linear
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams
from quasar_deploy.speculative.ngram import NgramDrafter

from .helpers import greedy, speculate

GPU = torch.device("cuda")
QUANTIZER = {"cpu": "torch", "cuda": "triton"}
ON_BOTH = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # the GPU half: tools/gpu_check.sh


def _int_mm_is_exact_on_cpu() -> bool:
    """Whether ``torch._int_mm`` on the CPU (oneDNN) sums in 32 bits: with VNNI it does; on AVX2 alone it sums product
    pairs in saturating 16 bits, which codes near 127 overflow."""
    codes = torch.full((2, 64), 127, dtype=torch.int8)
    return torch.equal(torch._int_mm(codes, codes.t().contiguous()).long(), codes.long() @ codes.t().long())


@pytest.fixture(autouse=True)
def exact_int_mm_on_cpu(monkeypatch):
    """The CPU stands in for the GPU in these tests, whose int8 GEMM (cuBLASLt's) is exact. Where the CPU's is not
    (no VNNI), an exact integer product stands in for it on CPU tensors: what is tested is the code around the GEMM."""
    if _int_mm_is_exact_on_cpu():
        return
    real = torch._int_mm

    def exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.long() @ b.long()).int() if a.device.type == "cpu" else real(a, b)

    monkeypatch.setattr(torch, "_int_mm", exact)


@pytest.fixture(params=["dynamic", "static", "int8-head"])
def artifact(request):
    names = {"dynamic": "tiny_artifact", "static": "tiny_static_artifact", "int8-head": "tiny_int8_head_artifact"}
    return request.getfixturevalue(names[request.param])


def linear_case(m: int, k: int, n: int, static: bool, bias: bool, dtype: torch.dtype, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wq, w_scale = quantize_weight(torch.randn(n, k, generator=g))
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    s = torch.tensor([0.02]) if static else None
    return [t.to(device) if t is not None else None for t in (x, wq, w_scale, b, s)]


def spec_decode(lm, prompt: list[int], n: int, k: int) -> list[int]:
    steps = speculate(lm, NgramDrafter(), prompt, Sampler(SamplingParams()), k, n)
    return [t for step in steps for t in step]


def repetitive_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4096) for _ in range(rng.randint(3, 12))] * 2 for _ in range(3)]


@pytest.mark.parametrize("rules", [CPU_RULES, CUDA_RULES], ids=["cpu-rules", "cuda-rules"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (6, 96, 40), (16, 64, 64), (17, 64, 64), (40, 32, 24), (5, 60, 37), (3, 13, 10)])
def test_linear_equals_the_reference_bit_for_bit(rules, static, dtype, m, k, n):
    """Exact int32 accumulation and the reference's epilogue order: not merely close, identical (padding included)."""
    x, wq, w_scale, bias, input_scale = linear_case(m, k, n, static, bias=True, dtype=dtype)
    got = Int8Linear(wq, w_scale, bias, input_scale, rules, quantize_rows_torch)(x)
    expected = reference_linear(x, wq, w_scale, bias, input_scale)
    assert got.dtype == dtype and got.shape == (m, n)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "m,k,n,rows,cols,weight",
    [(1, 64, 48, 17, 64, (64, 48)), (6, 96, 40, 17, 96, (96, 40)), (16, 8, 8, 17, 8, (8, 8)), (17, 64, 64, 17, 64, (64, 64)),
     (32, 64, 64, 32, 64, (64, 64)), (5, 60, 37, 17, 64, (64, 40)), (3, 13, 10, 17, 16, (16, 16))],
)  # fmt: skip
def test_cuda_shape_rules_pad_rows_and_odd_dimensions(m, k, n, rows, cols, weight):
    """M <= 16 is padded to 17 rows; K and N not multiples of 8 get zero columns / rows (once, at load, for the weight)."""
    assert CUDA_RULES.padded(m, k) == (rows, cols)
    assert CPU_RULES.padded(m, k) == (m, k)
    _, wq, w_scale, _, _ = linear_case(m, k, n, False, False, torch.float32)
    linear = Int8Linear(wq, w_scale, None, None, CUDA_RULES, quantize_rows_torch)
    assert tuple(linear.weight_t.shape) == weight
    assert torch.equal(linear.weight_t[:k, :n], wq.t()) and not linear.weight_t[k:].any() and not linear.weight_t[:, n:].any()


def test_rules_follow_the_device():
    assert IntMMRules.for_device("cuda:0") == CUDA_RULES and IntMMRules.for_device("cpu") == CPU_RULES


@pytest.mark.parametrize("static", [False, True])
def test_torch_quantizer_equals_the_scheme(static):
    x = (torch.randn(7, 60) * 4).to(torch.bfloat16)
    x[3] = 0  # an all-zero row gets the scheme's tiny scale, not a division by zero
    input_scale = torch.tensor([[0.01]]) if static else None
    q, scale = quantize_rows_torch(x, input_scale, 17, 64)
    expected_scale = per_token_scale(x) if input_scale is None else input_scale
    assert q.dtype == torch.int8 and q.shape == (17, 64)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q[:7, :60].float(), quantize_activation(x, expected_scale))
    assert not q[7:].any() and not q[:, 60:].any()
    if static:
        assert q.min() == -127  # saturates to -127 as the scheme does, never -128


def test_backend_on_cpu_matches_the_reference_decoder(artifact):
    """The cuda code path (static cache, masked attention, device kernels) against the cpu backend's reference kernels, both bf16."""
    reference_decoder = artifact.decoder(torch.bfloat16)
    reference_decoder.prepare("torch", "reference")
    reference = TorchCausalLM(reference_decoder)
    lm = cuda_backend.build_cuda_lm(artifact, "cpu", "torch")
    prompt = [11, 402, 7, 93, 1500, 64, 2048, 5, 77]
    expected, got = reference.prefill(prompt), lm.prefill(prompt)
    assert torch.allclose(got, expected, atol=0.05, rtol=0.05), (got - expected).abs().max()
    block = [3, 99, 1024]
    assert torch.allclose(lm.verify(block), reference.verify(block), atol=0.05, rtol=0.05)
    assert lm.length == reference.length == len(prompt) + len(block)


@ON_BOTH
def test_greedy_speculative_equals_the_backends_own_greedy_decode(artifact, device):
    lm = cuda_backend.build_cuda_lm(artifact, device, QUANTIZER[device])
    for prompt in repetitive_prompts(seed=1):
        expected = greedy(lm, prompt, 32)
        for k in (1, 5):
            assert spec_decode(lm, prompt, 32, k) == expected, (prompt, k)


@ON_BOTH
def test_a_verify_block_computes_the_bits_of_one_token_decodes(artifact, device):
    """Blocks run as BLOCK_ROWS rows whatever their length: row i of a verify equals the i-th single-token step exactly."""
    block_lm = cuda_backend.build_cuda_lm(artifact, device, QUANTIZER[device])
    step_lm = block_lm.new_sequence()
    prompt, block = [11, 402, 7, 93, 1500, 64], [3, 99, 1024, 5, 8, 13]
    block_lm.prefill(prompt)
    step_lm.prefill(prompt)
    together = block_lm.verify(block)
    one_by_one = torch.cat([step_lm.verify([token]) for token in block])
    assert torch.equal(together, one_by_one)


def test_a_block_ending_at_the_context_window(tiny_artifact):
    lm = cuda_backend.build_cuda_lm(tiny_artifact, "cpu", "torch", max_length=20)
    lm.prefill(list(range(1, 18)))
    assert lm.verify([1, 2, 3]).shape == (3, lm.vocab_size) and lm.length == 20  # padding rows land past the window, in the slack


def test_float_checkpoint_runs_in_bf16_with_the_same_code(tiny_qwen3):
    lm = cuda_backend.build_cuda_lm(open_model_files(tiny_qwen3), "cpu", "torch")
    assert lm.description.startswith("cuda float") and lm.decoder.dtype == torch.bfloat16
    prompt = repetitive_prompts(seed=2)[0]
    assert spec_decode(lm, prompt, 16, 4) == greedy(lm, prompt, 16)


def test_fused_projections_and_released_weights(tiny_artifact):
    """q/k/v and gate/up run as one kernel each; the members' own copies are released (one copy of each weight)."""
    lm = cuda_backend.build_cuda_lm(tiny_artifact, "cpu", "torch")
    layer = lm.decoder.model.layers[0]
    assert layer.self_attn.qkv is not None and layer.mlp.gate_up is not None
    assert all(m.weight.is_meta for m in (layer.self_attn.q_proj, layer.mlp.up_proj, layer.self_attn.o_proj))


def test_static_cache_grows_in_spans_and_keeps_its_contents(tiny_qwen3):
    lm = cuda_backend.build_cuda_lm(open_model_files(tiny_qwen3), "cpu", "torch", max_length=4 * SPAN)
    lm.prefill(list(range(1, SPAN)))
    first_keys = lm.cache.keys[0][:, : SPAN - 1].clone()
    assert lm.cache.capacity == SPAN
    lm.verify([5, 6, 7])  # crosses the span: the buffers move, their contents come along
    assert lm.cache.capacity == 2 * SPAN and lm.cache.span(lm.length) == 2 * SPAN
    assert torch.equal(lm.cache.keys[0][:, : SPAN - 1], first_keys)
    assert StaticCache(lm.spec, torch.bfloat16, "cpu", 300).span(290) == 300  # never past the context window


def test_context_window_and_truncation(tiny_artifact):
    lm = cuda_backend.build_cuda_lm(tiny_artifact, "cpu", "torch", max_length=12)
    lm.prefill(list(range(1, 11)))
    with pytest.raises(QuasarError, match="exceeds the context window"):
        lm.verify([1, 2, 3])
    lm.truncate(4)
    assert lm.length == 4 and lm.new_sequence().length == 0


def test_layer_skipping_steps_run_eagerly(tiny_artifact):
    lm = cuda_backend.build_cuda_lm(tiny_artifact, "cpu", "torch")
    lm.prefill([1, 2, 3])
    assert lm.verify_skipping([4, 5], frozenset({1})).shape == (2, lm.vocab_size)


def test_triton_quantizer_refused_off_cuda(tiny_artifact):
    with pytest.raises(QuasarError, match="CUDA devices only"):
        cuda_backend.build_cuda_lm(tiny_artifact, "cpu", "triton")
    with pytest.raises(QuasarError, match="quantizer must be one of"):
        cuda_backend.make_quantizer("fast", torch.device("cpu"))


def test_unavailable_names_each_reason(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "no CUDA support" in cuda_backend.unavailable()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no GPU visible" in cuda_backend.unavailable()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 0))
    assert cuda_backend.unavailable() == "Tesla V100 has compute capability 7.0: no int8 tensor cores (needs 7.5, Turing, or newer)"
    status = cuda_backend.gpu_status()
    assert status["gpu"] == "Tesla V100" and status["compute_capability"] == "7.0" and status["int8_tensor_cores"] is False
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    assert cuda_backend.unavailable() is None and cuda_backend.gpu_status()["int8_tensor_cores"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_registered_refused_here_and_auto_falls_back(naive_artifact):
    assert "cuda" in BACKENDS
    with pytest.raises(QuasarError, match="backend 'cuda' cannot run here"):
        create_backend("cuda", open_model_files(naive_artifact))
    with pytest.raises(QuasarError, match="backend 'cuda' cannot run here"):
        cuda_backend.load_cuda(open_model_files(naive_artifact))
    assert auto_backend(open_model_files(naive_artifact)) in ("onnxruntime", "cpu")  # ONNX Runtime where it is installed
    assert auto_backend(open_model_files(naive_artifact), needs=("layer_skip",)) in ("onnxruntime", "cpu")  # its layer graphs, or torch's


def test_doctor_reports_the_gpu_status():
    from quasar_deploy.doctor import report

    info = report()
    assert info["targets"]["cuda"] == cuda_backend.unavailable()
    assert info["gpu"]["reason"] == cuda_backend.unavailable() and "triton" in info["gpu"]


# --- on a GPU (tools/gpu_check.sh) ---


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m,k", [(1, 2048), (6, 6144), (17, 4096), (300, 1000), (5, 12288)])
def test_triton_quantizer_equals_the_torch_one(static, m, k):
    from quasar_deploy.backends.cuda_triton import quantize_rows_triton

    x = (torch.randn(m, k, device=GPU) * 5).to(torch.bfloat16)
    x[0] = 0
    input_scale = torch.tensor([[0.03]], device=GPU) if static else None
    rows, cols = CUDA_RULES.padded(m, k)
    q, scale = quantize_rows_triton(x, input_scale, rows, cols)
    q_ref, scale_ref = quantize_rows_torch(x, input_scale, rows, cols)
    assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 2048, 6144), (6, 4096, 1024), (17, 512, 512), (5, 60, 37)])
def test_gpu_linear_equals_the_reference(static, m, k, n):
    """On tensor cores: the integer accumulation is exact, the epilogue the reference's (elementwise float32)."""
    from quasar_deploy.backends.cuda_triton import quantize_rows_triton

    x, wq, w_scale, bias, input_scale = linear_case(m, k, n, static, True, torch.bfloat16, device=GPU)
    got = Int8Linear(wq, w_scale, bias, input_scale, CUDA_RULES, quantize_rows_triton)(x)
    expected = reference_linear(x.cpu(), wq.cpu(), w_scale.cpu(), bias.cpu(), None if input_scale is None else input_scale.cpu())
    assert torch.equal(got.cpu(), expected)


@pytest.mark.gpu
def test_graph_replay_equals_eager(artifact):
    graphed = cuda_backend.build_cuda_lm(artifact, GPU, "triton", graphs=True)
    eager = cuda_backend.build_cuda_lm(artifact, GPU, "triton", graphs=False)
    prompt = repetitive_prompts(seed=3)[1]
    assert torch.equal(graphed.prefill(prompt), eager.prefill(prompt))
    for block in ([5], [7, 8, 9, 10, 11, 12], [13], [14, 15]):
        assert torch.equal(graphed.verify(block), eager.verify(block)), block
    graphed.truncate(len(prompt) + 2)
    eager.truncate(len(prompt) + 2)
    assert torch.equal(graphed.verify([1, 2, 3]), eager.verify([1, 2, 3]))  # rolled back, replayed at another position


def _forced_logits(lm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits before each of ``tokens``, fed one at a time after ``prompt`` (teacher forcing: both sides see one path)."""
    rows = [lm.prefill(prompt)]
    rows += [lm.verify([token])[-1] for token in tokens[:-1]]
    return torch.stack([row.float().cpu() for row in rows])


@pytest.mark.gpu
def test_gpu_agrees_with_the_cpu_reference(artifact):
    """On the reference's greedy path, the GPU backend's logits equal the cpu reference kernels' in bf16 within the
    tolerance the cpu run of the same code path meets (``test_backend_on_cpu_matches_the_reference_decoder``): so greedy
    continuations can part only at near-ties, never by a wrong computation."""
    decoder = artifact.decoder(torch.bfloat16)
    decoder.prepare("torch", "reference")
    reference = TorchCausalLM(decoder)
    lm = cuda_backend.build_cuda_lm(artifact, GPU, "triton")
    for prompt in repetitive_prompts(seed=5):
        path = greedy(reference, prompt, 32)
        expected, got = _forced_logits(reference, prompt, path), _forced_logits(lm, prompt, path)
        assert torch.allclose(got, expected, atol=0.05, rtol=0.05), (got - expected).abs().max()


# --- bench gpu: what runs without a GPU ---

RECORDED = {
    "gpu": "NVIDIA H200",
    "torch": "2.11.0+cu128",
    "settings": dict(tokens=6, context=512, repeats=30, prompts=5, max_new_tokens=128, num_draft=5),
    "verify": [{"shape": "qwen3-8b", "bf16_ms": 3.5, "w8a8_ms": 2.0, "ratio": 1.75, "ratio_range": [1.6, 1.9], "ideal_ratio": 1.95}],
    "gemm": {
        "shape": [12288, 4096],
        "copy_bandwidth_gb_s": 4000.0,
        "rows": [{"m": 6, "gemm_rows": 17, "int8_ms": 0.0151, "int8_fraction": 0.8333, "bf16_ms": 0.0302, "bf16_fraction": 0.8334}],
    },
    "e2e": [
        {
            "model": "demo",
            "weights": "trained",
            "bf16_tokens_per_s": 400.0,
            "w8a8_tokens_per_s": 520.0,
            "ratio": 1.3,
            "acceptance_bf16": 2.5,
            "acceptance_w8a8": 2.4,
        }
    ],
}


def test_gpu_table_from_a_recorded_result():
    from quasar_deploy.bench.gpu import table

    lines = table(RECORDED).splitlines()
    assert lines[0].startswith("GPU: NVIDIA H200 (torch 2.11.0+cu128)")
    assert any(line.split()[:4] == ["qwen3-8b", "3.500", "2.000", "1.75x"] and line.endswith("90%") for line in lines)
    assert any(line.split() == ["6", "17", "0.0151", "83%", "0.0302", "83%"] for line in lines)
    assert any(line.split()[:6] == ["demo", "trained", "400.0", "520.0", "1.30x", "2.50/2.40"] for line in lines)
    assert "copy bandwidth (4000 GB/s)" in "\n".join(lines)


def test_the_device_check_writes_a_bench_record(tmp_path, monkeypatch, capsys):
    """``python -m quasar_deploy.bench.gpu --json-out`` (tools/gpu_check.sh) writes what ``bench gpu --json`` prints: a
    record the benchmarks page reads, its figures the run's result."""
    from quasar_deploy.bench import gpu as gpu_bench
    from quasar_deploy.bench.record import current, read_records

    monkeypatch.setattr(gpu_bench, "run", lambda settings, log: RECORDED)
    assert gpu_bench.main(["--json-out", str(tmp_path / "gpu-check.json")]) == 0
    assert capsys.readouterr().out.startswith("GPU: NVIDIA H200")
    (record,) = read_records([tmp_path])
    assert (record["command"], record["figures"], record["options"]["quantizer"]) == ("bench gpu", RECORDED, "triton")
    assert "GPU: NVIDIA H200" in current([record])


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(shapes=("qwen3-9b",)), "unknown synthetic shape 'qwen3-9b'"),
        (dict(e2e_shape="nope"), "unknown synthetic shape 'nope'"),
        (dict(tokens=17), "at most 16"),
        (dict(context=0), "context must be at least 1"),
        (dict(rows=(1, 0)), "rows must be positive"),
    ],
)
def test_gpu_settings_are_checked_before_any_work(options, message):
    from quasar_deploy.bench.gpu_settings import GpuSettings

    with pytest.raises(QuasarError, match=message):
        GpuSettings(**options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_gpu_refuses_clearly_without_cuda():
    from click.testing import CliRunner

    from quasar_deploy.cli import main

    from .helpers import assert_one_line_error

    assert_one_line_error(CliRunner().invoke(main, ["bench", "gpu"]), "bench gpu needs the cuda backend: ", only_line=True)
    assert_one_line_error(CliRunner().invoke(main, ["bench", "gpu", "--shapes", "qwen3-9b"]), "unknown synthetic shape")


def test_gpu_ngram_benchmark_glue_on_cpu(tiny_qwen3, tiny_artifact):
    """The end-to-end part of ``bench gpu`` over two backends built on the CPU: each row's acceptance lengths are those of
    n-gram decoding on the built-in prompts with its settings (timings are not asserted), and the table prints the row."""
    from quasar_deploy.bench.gpu import _ngram_benchmark, table
    from quasar_deploy.bench.gpu_settings import GpuSettings
    from quasar_deploy.calibration.data import BUILTIN, read_texts
    from quasar_deploy.engine import Engine
    from quasar_deploy.tokenizer import load_tokenizer

    float_lm = cuda_backend.build_cuda_lm(open_model_files(tiny_qwen3), "cpu", "torch")
    quant_lm = cuda_backend.build_cuda_lm(tiny_artifact, "cpu", "torch")
    settings = GpuSettings(prompts=2, max_new_tokens=8, num_draft=3)
    tokenizer = load_tokenizer(open_model_files(tiny_qwen3))
    row = _ngram_benchmark("tiny", float_lm, quant_lm, tokenizer, "random", settings)
    for lm, key in ((float_lm, "acceptance_bf16"), (quant_lm, "acceptance_w8a8")):
        engine = Engine(lm, tokenizer, frozenset(), "cuda")
        runs = [engine.generate(p, max_new_tokens=8, draft="ngram", num_draft=3) for p in read_texts(BUILTIN["prompts"])[:2]]
        assert row[key] == pytest.approx(sum(r.stats.acceptance_length for r in runs) / 2), key
    assert (row["model"], row["weights"]) == ("tiny", "random")
    ratio = f"{row['ratio']:.2f}x"
    assert any(
        line.split()[:5] == ["tiny", "random", f"{row['bf16_tokens_per_s']:.1f}", f"{row['w8a8_tokens_per_s']:.1f}", ratio]
        for line in table(RECORDED | {"e2e": [row]}).splitlines()
    )
