"""Lean benchmarks: shapes that cannot fit are refused up front, synthetic twins share what they can, and transformers'
model never holds memory beside our engines."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from click.testing import CliRunner

from quasar_deploy.bench import memory, synthetic
from quasar_deploy.bench.contenders import synthetic_contenders, trained_contenders
from quasar_deploy.bench.e2e import BenchSettings, benchmark
from quasar_deploy.bench.micro import kernels_peak_bytes, linear_sizes, verify_step, weight_bytes
from quasar_deploy.cli import main
from quasar_deploy.cpu.choice import default_int8_kernel
from quasar_deploy.cpu.linears import default_float_kernel
from quasar_deploy.errors import QuasarError
from quasar_deploy.scheme import quantize_weight

from .helpers import skip_without_bf16

GB = 10**9


@pytest.fixture
def small_shape(monkeypatch):
    """A published-shape entry small enough for a test: hidden 64, 2 layers, vocabulary 512, tied embeddings."""
    monkeypatch.setitem(synthetic.SHAPES, "test-tiny", (64, 128, 2, 4, 2, 16, 512, True))
    return "test-tiny"


def test_memory_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert memory.memory_available(meminfo) == 20000000 * 1024
    assert memory.memory_available(tmp_path / "missing") > 10**15  # unknown: never refuse


def test_what_cannot_fit_is_refused_with_the_estimate():
    needed = synthetic.engines_peak_bytes(synthetic.synthetic_spec("qwen3-8b"))
    # float linears (27.8 GB) + bf16 table (1.24 GB) + packed float32 head (2.49 GB) + int8 linears (6.95 GB) + libraries
    assert 39 * GB < needed < 40 * GB
    with pytest.raises(QuasarError, match=r"^bench e2e --synthetic qwen3-8b needs ~39\.\d GB, this machine has 20\.0 GB available$"):
        memory.check_fits(needed, "bench e2e --synthetic qwen3-8b", available=20 * GB)
    memory.check_fits(needed, "fits", available=needed)


def test_the_qwen3_1_7b_estimate_adds_up():
    # 5.64 GB float linears (oneDNN-packed), 0.62 GB bf16 table, 1.24 GB packed lm_head shared by both engines,
    # 1.41 GB int8, 1 GB for the libraries
    assert synthetic.engines_peak_bytes(synthetic.synthetic_spec("qwen3-1.7b")) == pytest.approx(9.92 * GB, rel=0.01)


@pytest.mark.parametrize(
    "command",
    [["e2e", "--synthetic", "qwen3-8b"], ["verify-step", "--synthetic", "qwen3-8b"], ["kernels", "--synthetic", "qwen3-8b"]],
)
def test_bench_commands_refuse_before_allocating(monkeypatch, tmp_path, command):
    monkeypatch.setattr(memory, "memory_available", lambda: GB // 2)  # fake: allocating to prove it would be slow and unkind
    result = CliRunner().invoke(main, ["bench", *command, "-o", str(tmp_path)] if command[0] == "e2e" else ["bench", *command])
    assert result.exit_code == 1, result.output
    assert f"{command[0]} --synthetic qwen3-8b needs ~" in result.output and "this machine has 0.5 GB available" in result.output


def test_the_kernel_benchmark_estimate_is_its_largest_size():
    sizes = linear_sizes(synthetic.synthetic_spec("qwen3-8b"))
    assert (12288, 4096) in sizes and len(sizes) == 4  # q and o are square at 8B: one size
    # two copies of the largest (>= 256 MB of float weights), float + packed + int8 bytes each; 1 GiB of copy buffers; libraries
    assert kernels_peak_bytes(sizes) == 9 * 2 * 12288 * 4096 + 2**30 + synthetic.LIBRARIES_BYTES


def test_random_tensors_do_not_depend_on_the_order_they_are_drawn_in(small_shape):
    spec = synthetic.synthetic_spec(small_shape)
    names = sorted(synthetic.RandomTensors(spec).names)
    forward = {n: synthetic.RandomTensors(spec).tensor(n) for n in names}
    backward = synthetic.RandomTensors(spec)
    assert all(torch.equal(backward.tensor(n), forward[n]) for n in reversed(names))


def test_synthetic_twins_share_embedding_and_one_packed_head(small_shape):
    plain_float, plain_w8a8 = synthetic.synthetic_decoders(small_shape)
    assert plain_w8a8.model.embed_tokens.weight.data_ptr() == plain_float.model.embed_tokens.weight.data_ptr()  # one copy
    weight = plain_float.model.layers[1].mlp.down_proj.weight
    assert torch.equal(plain_w8a8.model.layers[1].mlp.down_proj.weight, quantize_weight(weight)[0])  # the same random draw

    float_model, w8a8 = synthetic.synthetic_decoders(small_shape, kernels=(default_float_kernel(), default_int8_kernel()))
    assert w8a8.lm_head is float_model.lm_head and w8a8.lm_head.weight.is_meta
    table = float_model.model.embed_tokens.weight  # the draws' bf16, shared (the head packed a float32 copy)
    assert table.dtype == torch.bfloat16 and w8a8.model.embed_tokens.weight.data_ptr() == table.data_ptr()
    ids = torch.arange(3, 11)
    expected = [d(ids, d.new_cache()) for d in (plain_float, plain_w8a8)]
    for got, want in zip((float_model(ids, float_model.new_cache()), w8a8(ids, w8a8.new_cache())), expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_verify_step_reports_its_run_against_the_bytes_ideal(small_shape):
    """The figures are timings (not asserted); what the report derives from them and from the shape is."""
    result = verify_step(small_shape, tokens=3, context=8, repeats=3, progress=False)
    spec = synthetic.synthetic_spec(small_shape)
    float_model, w8a8 = synthetic.synthetic_decoders(small_shape, kernels=(default_float_kernel(), default_int8_kernel()))
    assert list(result.float_ms) == ["float32"] and result.best_float == "float32" and result.head_dtype == "float32"
    assert result.ideal_ratio == weight_bytes(float_model) / weight_bytes(w8a8)  # float linears and head over int8 ones
    assert result.ideal_ratio == synthetic.step_read_bytes(spec, quantized=False) / synthetic.step_read_bytes(spec, quantized=True)
    low, high = result.ratio_spread
    assert 0 < low <= result.ratio <= high and result.fraction_of_ideal == result.ratio / result.ideal_ratio
    assert (result.tokens, result.context, result.repeats, result.threads) == (3, 8, 3, torch.get_num_threads())
    assert (result.float_kernel, result.int8_kernel) == (default_float_kernel(), default_int8_kernel())


def test_verify_step_is_against_the_fastest_float_contender(small_shape):
    """float32 and bf16 both run; the ratio and the ideal bytes are the fastest one's, whichever it is on this CPU."""
    skip_without_bf16()
    result = verify_step(small_shape, tokens=3, context=8, repeats=2, progress=False, float_dtypes=(torch.float32, torch.bfloat16))
    assert set(result.float_ms) == {"float32", "bfloat16"} and result.head_dtype == "bfloat16"
    assert result.best_float == min(result.float_ms, key=result.float_ms.get)
    low, high = result.ratio_spread
    assert 0 < low <= result.ratio <= high
    # bf16 reads half the float32 bytes, the W8A8 twin's bf16 head too: the ideal follows the baseline chosen
    assert result.ideal_ratio > 1 and result.fraction_of_ideal == pytest.approx(result.ratio / result.ideal_ratio)


def test_a_kernel_this_cpu_lacks_is_one_line(small_shape, monkeypatch):
    from quasar_deploy.cpu import linears

    monkeypatch.setattr(linears, "vnni_available", lambda: False)
    with pytest.raises(QuasarError, match="needs a CPU with AVX-512 VNNI"):
        verify_step(small_shape, tokens=3, context=8, repeats=1, int8_kernel="fbgemm-vnni", progress=False)


def test_transformers_model_is_freed_before_the_engines_load(tiny_qwen3, tiny_artifact, tmp_path):
    contenders = trained_contenders(tiny_qwen3, tiny_artifact.path)
    loaded, build, contenders_load_hf = [], contenders.build_engines, contenders.load_hf

    def load_hf():
        model = contenders_load_hf()
        loaded.append(weakref.ref(model))
        return model

    def build_engines():
        gc.collect()
        assert loaded and loaded[0]() is None, "transformers' model is still alive while the engines load"
        return build()

    contenders.load_hf, contenders.build_engines = load_hf, build_engines
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["def f(x):"]}\n{"turns": ["class A:"]}\n')
    settings = BenchSettings(prompts=str(prompts), limit=2, max_new_tokens=4, modes=("hf-prompt-lookup", "ngram-float"))
    report = benchmark(settings, contenders, progress=False)
    assert report["settings"]["timed_in_own_phase"] == ["hf-prompt-lookup"]
    assert report["modes"]["hf-prompt-lookup"]["new_tokens"] > 0 and report["modes"]["ngram-float"]["new_tokens"] > 0


def test_synthetic_contenders_are_refused_before_any_tensor_is_drawn(monkeypatch):
    monkeypatch.setattr(memory, "memory_available", lambda: GB)
    with pytest.raises(QuasarError, match="needs ~"):
        synthetic_contenders("qwen3-1.7b")


def test_the_cpu_paths_step_times_every_contender_round_robin(small_shape, monkeypatch):
    pytest.importorskip("onnxruntime")
    from quasar_deploy.bench import onnx as bench_onnx

    lines = list(bench_onnx.step(small_shape, tokens=3, context=8, threads=1, repeats=2, int8_lm_head=True))
    assert "W8A8 with an int8 lm_head" in lines[0]
    labels = ["ORT fp32", "ORT W8A8 integer", "torch float", "torch W8A8"]
    assert [next(i for i, line in enumerate(lines) if label in line) for label in labels] == [1, 2, 3, 4]
    assert all("the best float" in lines[i] for i in (2, 4)) and "ideal W8A8 speed-up" in lines[5]
    # exact mode modelled from these costs: each W8A8 contender as the middle level under the torch float verifier
    assert "exact mode at acceptance 1.4" in lines[6] and "torch float" in lines[6]
    assert [line.split(" per float step")[0].split()[-1].isdigit() for line in lines[7:]] == [True, True]
    assert "ORT W8A8 integer" in lines[7] and "torch W8A8" in lines[8] and all(line.endswith("verification") for line in lines[7:])
    assert "2 rounds" in lines[0]


def test_contenders_that_do_not_fit_together_are_timed_one_at_a_time(small_shape, monkeypatch):
    """An 8B shape on 24 GB: each contender built, timed and freed before the next; one that does not fit even alone is
    left out with a line that says so; none fitting alone is refused in one line."""
    pytest.importorskip("onnxruntime")
    from quasar_deploy.bench import onnx as bench_onnx

    together = bench_onnx.step_peak_bytes(synthetic.synthetic_spec(small_shape), True, True)
    monkeypatch.setattr(memory, "memory_available", lambda: together - 1)
    lines = list(bench_onnx.step(small_shape, tokens=3, context=8, threads=1, repeats=2, int8_lm_head=True))
    assert "2 calls each, one contender at a time" in lines[0]
    labels = ["ORT fp32", "ORT W8A8 integer", "torch float", "torch W8A8"]
    assert [next(i for i, line in enumerate(lines) if label in line) for label in labels] == [1, 2, 3, 4]
    assert all("the best float" in lines[i] for i in (2, 4)) and "ideal W8A8 speed-up" in lines[5]
    assert "exact mode at acceptance 1.4" in lines[6] and len(lines) == 9  # the float decoder's longer steps were timed

    monkeypatch.setattr(bench_onnx, "SESSION_BUILD_FACTOR", 10**9)  # no ORT session fits, alone or not
    monkeypatch.setattr(memory, "memory_available", lambda: 8 * GB)
    lines = list(bench_onnx.step(small_shape, tokens=3, context=8, threads=1, repeats=2))
    assert [line.split()[1] for line in lines[1:3]] == ["float", "W8A8"] and "the best float" in lines[2]
    assert [line.split()[:2] for line in lines[3:5]] == [["ORT", "fp32"], ["ORT", "W8A8"]]
    assert all("left out: it needs ~" in line for line in lines[3:5])
    monkeypatch.setattr(memory, "memory_available", lambda: GB // 2)  # not even the libraries
    with pytest.raises(QuasarError, match=r"one contender at a time needs ~1\.0 GB, this machine has 0\.5 GB available$"):
        next(bench_onnx.step(small_shape, tokens=3, context=8, threads=1, repeats=2))


def test_int8_lm_head_twin_quantizes_the_float_twins_head(small_shape):
    """``verify-step --int8-lm-head``: the W8A8 twin's own int8 head holds the float head's values (the tied embedding)."""
    float_model, w8a8 = synthetic.synthetic_decoders(small_shape, int8_lm_head=True)
    assert w8a8.lm_head.quantized and not w8a8.spec.tie_word_embeddings and float_model.spec.tie_word_embeddings
    wq, scale = quantize_weight(float_model.lm_head.weight)
    assert torch.equal(w8a8.lm_head.weight, wq) and torch.equal(w8a8.lm_head.weight_scale, scale)
    assert weight_bytes(w8a8) < weight_bytes(synthetic.synthetic_decoders(small_shape)[1])
    spec = synthetic.synthetic_spec(small_shape)
    head = spec.vocab_size * spec.hidden_size
    float_linears, int8_linears = synthetic._linear_bytes(spec)
    engines = float_linears + (4 + 2) * head + int8_linears  # packed float linears and head, bf16 table, int8 linears
    quantizing = (2 + 3 * 4) * head  # the head's bf16 draw and three float32 copies in quantize_weight
    assert synthetic.engines_peak_bytes(spec, int8_lm_head=True) == engines + quantizing + synthetic.LIBRARIES_BYTES
    result = verify_step(small_shape, tokens=3, context=8, repeats=2, progress=False, int8_lm_head=True)
    assert result.int8_lm_head and result.ideal_ratio > 1


@pytest.mark.parametrize("int8_lm_head", [False, True], ids=["float-head", "int8-head"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_step_bench_streams_the_graphs_an_in_memory_build_would_make(small_shape, monkeypatch, tmp_path, tied, int8_lm_head):
    """``bench onnx step`` writes its graphs layer by layer into ``model.onnx.data``: the very nodes and initializers of
    ``decoder_graph`` on the whole decoder, float and W8A8, from the same random draws."""
    pytest.importorskip("onnxruntime")
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from quasar_deploy.bench import onnx as bench_onnx
    from quasar_deploy.model import Decoder

    from .helpers import decoder_graph

    monkeypatch.setitem(synthetic.SHAPES, small_shape, (*synthetic.SHAPES[small_shape][:-1], tied))
    spec = synthetic.synthetic_spec(small_shape)
    twins = {
        "float": ((spec, synthetic.RandomTensors(spec)), Decoder(spec, synthetic.RandomTensors(spec))),
        "w8a8": (
            synthetic.w8a8_source(small_shape, int8_lm_head=int8_lm_head),
            synthetic.synthetic_w8a8_decoder(small_shape, 0, int8_lm_head),
        ),
    }
    for label, (source, decoder) in twins.items():
        (tmp_path / label).mkdir()
        bench_onnx.write_synthetic_graph(tmp_path / label, *source, label)
        assert (tmp_path / label / "model.onnx.data").stat().st_size > 0
        streamed, in_memory = onnx.load(str(tmp_path / label / "model.onnx")), decoder_graph(decoder, label)
        assert [n.op_type for n in streamed.graph.node] == [n.op_type for n in in_memory.graph.node]
        expected = {t.name: numpy_helper.to_array(t) for t in in_memory.graph.initializer}
        got = {t.name: numpy_helper.to_array(t) for t in streamed.graph.initializer}
        assert got.keys() == expected.keys()
        for name, array in expected.items():
            np.testing.assert_array_equal(got[name], array, err_msg=f"{label}: {name}")


@pytest.mark.parametrize("int8_lm_head", [False, True], ids=["float-head", "int8-head"])
def test_the_ideal_ratio_counts_the_bytes_the_decoders_read(small_shape, int8_lm_head):
    spec = synthetic.synthetic_spec(small_shape)
    kernels = (default_float_kernel(), default_int8_kernel())  # prepared: a float head read as its kernel keeps it
    float_model, w8a8 = synthetic.synthetic_decoders(small_shape, kernels=kernels, int8_lm_head=int8_lm_head)
    assert synthetic.step_read_bytes(spec, quantized=False) == weight_bytes(float_model)
    assert synthetic.step_read_bytes(spec, quantized=True, int8_lm_head=int8_lm_head) == weight_bytes(w8a8)


def test_the_step_estimate_lets_a_streamed_1_7b_run_fit_24_gb_and_refuses_what_cannot():
    """The graphs are streamed (the build holds about one table, not the model), so Qwen3-1.7B without the torch
    contenders fits a 24 GB machine (12.5 GB measured); the torch engines add theirs; an 8B shape does not fit
    together (the command then times one contender at a time), which a check says in one line."""
    pytest.importorskip("onnxruntime")
    from quasar_deploy.bench import onnx as bench_onnx

    spec = synthetic.synthetic_spec("qwen3-1.7b")
    assert bench_onnx.step_peak_bytes(spec, with_torch=False) < 20 * GB
    assert bench_onnx.step_peak_bytes(spec, with_torch=True) > bench_onnx.step_peak_bytes(spec, with_torch=False) + 5 * GB
    assert bench_onnx.step_peak_bytes(spec, with_torch=False, int8_lm_head=True) < 20 * GB
    needed = bench_onnx.step_peak_bytes(synthetic.synthetic_spec("qwen3-8b"), with_torch=False)
    with pytest.raises(QuasarError, match=rf"needs ~{needed / GB:.1f} GB, this machine has 24\.0 GB available$"):
        memory.check_fits(needed, "bench onnx step --synthetic qwen3-8b", available=24 * GB)


@pytest.mark.parametrize(("int8_kernel", "auto"), [("onednn-vnni", "ORT W8A8 + bf16 head (auto)"), ("quasar", "torch W8A8 ")])
def test_the_cpu_paths_step_includes_bf16_where_the_cpu_computes_it(small_shape, monkeypatch, int8_kernel, auto):
    """On a bf16 CPU (monkeypatched probe): torch's float decoder in bf16, and ORT's graph with its head in bf16 beside
    it; the ideal ratio is against bf16. "(auto)" marks the W8A8 contender auto runs, as the int8 probe decides."""
    pytest.importorskip("onnxruntime")
    from quasar_deploy.bench import onnx as bench_onnx
    from quasar_deploy.cpu import choice, linears

    skip_without_bf16()  # the probe says bf16 below, and the kernels then run it
    monkeypatch.delenv(linears.FLOAT_DTYPE_ENV, raising=False)
    monkeypatch.setattr(linears, "float_probe", lambda: linears.FloatProbe(4.0, 1.5, 256))
    monkeypatch.setattr(choice, "default_int8_kernel", lambda device="cpu": int8_kernel)
    monkeypatch.setattr(choice, "int8_probe", lambda: choice.Int8Probe({int8_kernel: 1.0, choice.ONNXRUNTIME: 2.0}))
    lines = list(bench_onnx.step(small_shape, tokens=3, context=8, threads=1, repeats=2))
    assert "float dtype bfloat16" in lines[0] and "against bfloat16 float" in lines[5]
    assert sum("(auto)" in line for line in lines[1:5]) == 1 and any(auto in line and "(auto)" in line for line in lines[1:5])
    labels = ["ORT fp32", "ORT W8A8 + bf16 head", "torch float bfloat16", "torch W8A8"]
    assert [next(i for i, line in enumerate(lines) if label in line) for label in labels] == [1, 2, 3, 4]
    assert all("the best float" in lines[i] for i in (2, 4)) and not any("W8A8 integer" in line for line in lines)
