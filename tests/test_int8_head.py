"""The int8 lm_head (``calibrate --int8-lm-head``): what the artifact holds, that every runtime runs it as a W8A8 linear,
that speculative decoding stays lossless to the verifier, and that the exports and inflation handle it or refuse it."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from quasar_deploy import calibrate, load
from quasar_deploy.artifact import open_model_files
from quasar_deploy.calibration import CalibrationRecipe
from quasar_deploy.cli import main
from quasar_deploy.cpu.choice import default_int8_kernel
from quasar_deploy.errors import QuasarError
from quasar_deploy.memory import estimate
from quasar_deploy.scheme import QMAX, quantize_weight, reference_linear

from .helpers import FAST_CALIBRATION, ONNX_PROMPT, copy_dir

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(", "import os\nimport sys\nimport os\n", "x = x + 1\nx = x + 1\nx ="]


@pytest.fixture(scope="module")
def static_head(tiny_qwen3_tied, tmp_path_factory):
    """The tied model calibrated with static activations and an int8 head: one calibrated input scale for the head too."""
    return calibrate(
        tiny_qwen3_tied, tmp_path_factory.mktemp("static-head") / "w8a8", activation="static", int8_lm_head=True, **FAST_CALIBRATION
    )


def test_recipe_takes_a_switch_only():
    assert CalibrationRecipe().int8_lm_head is False and CalibrationRecipe(int8_lm_head=True).to_dict()["int8_lm_head"] is True
    with pytest.raises(QuasarError, match=r"^--int8-lm-head is a switch \(True or False\), not 'yes'$"):
        CalibrationRecipe(int8_lm_head="yes")


def test_cli_flag_writes_an_int8_head(tiny_qwen3_tied, tmp_path):
    args = ["calibrate", str(tiny_qwen3_tied), "-o", str(tmp_path / "a"), "--num-samples", "2", "--seq-len", "16", "--int8-lm-head"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "22 linear layers in W8A8, 0 kept in float (+ embeddings; lm_head in W8A8)" in result.output
    manifest = json.loads((tmp_path / "a" / "quasar.json").read_text())
    assert manifest["recipe"]["int8_lm_head"] is True and manifest["quantized_layers"][-1] == "lm_head"


def test_tied_source_gets_its_own_int8_head_and_an_untied_config(tiny_int8_head_artifact, tiny_qwen3_tied):
    from compressed_tensors.quantization import QuantizationConfig

    path = tiny_int8_head_artifact.path
    config = json.loads((path / "config.json").read_text())
    assert json.loads((tiny_qwen3_tied / "config.json").read_text())["tie_word_embeddings"] is True
    assert config["tie_word_embeddings"] is False  # consumers must not tie the float embeddings to the int8 head again
    assert "lm_head" not in QuantizationConfig.model_validate(config["quantization_config"]).ignore
    with safe_open(tiny_qwen3_tied / "model.safetensors", "pt") as f:
        embeddings = f.get_tensor("model.embed_tokens.weight")
    with safe_open(path / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), embeddings)  # still float, for lookups
        wq, scale = quantize_weight(embeddings)
        assert torch.equal(f.get_tensor("lm_head.weight"), wq) and torch.equal(f.get_tensor("lm_head.weight_scale"), scale)
        assert "lm_head.input_scale" not in f.keys()
    manifest = tiny_int8_head_artifact.manifest
    assert manifest["recipe"]["int8_lm_head"] is True and manifest["quantized_layers"] == [*manifest["layers"]]
    head = manifest["layers"]["lm_head"]
    assert head["quantized"] and 0 < head["error"] < 1e-2
    spec = tiny_int8_head_artifact.spec
    assert not spec.tie_word_embeddings
    layers = sum(lin.weight.numel() + 4 * lin.out_features for _, lin in tiny_int8_head_artifact.decoder().linears())
    assert estimate(tiny_int8_head_artifact).int8_weights == layers + spec.vocab_size * (spec.hidden_size + 4)


def test_float_head_by_default_and_in_artifacts_from_before_the_option(tiny_artifact, tmp_path):
    config = json.loads((tiny_artifact.path / "config.json").read_text())
    assert "lm_head" in config["quantization_config"]["ignore"] and tiny_artifact.manifest["recipe"]["int8_lm_head"] is False
    old = copy_dir(tiny_artifact.path, tmp_path)
    record = json.loads((old / "quasar.json").read_text())
    del record["recipe"]["int8_lm_head"]
    (old / "quasar.json").write_text(json.dumps(record))
    decoder = open_model_files(old).decoder()
    assert not decoder.lm_head.quantized and decoder.lm_head.weight.dtype == torch.float32


def test_manifest_must_list_the_int8_head(tiny_int8_head_artifact, tmp_path):
    copy = copy_dir(tiny_int8_head_artifact.path, tmp_path)
    record = json.loads((copy / "quasar.json").read_text())
    record["quantized_layers"].remove("lm_head")
    (copy / "quasar.json").write_text(json.dumps(record))
    with pytest.raises(QuasarError, match=r"layer 'lm_head' does not match the manifest \(corrupted artifact\)$"):
        open_model_files(copy).decoder()


def test_cpu_kernels_run_the_head_as_the_schemes_w8a8_linear(tiny_int8_head_artifact):
    files = tiny_int8_head_artifact
    wq, scale = files.checkpoint.tensor("lm_head.weight"), files.checkpoint.tensor("lm_head.weight_scale")
    ids = torch.tensor(ONNX_PROMPT)
    logits = {}
    for kernel in ("reference", default_int8_kernel()):
        decoder = files.decoder()
        decoder.prepare("torch", kernel, fuse=True)
        seen = {}
        decoder.lm_head.register_forward_hook(lambda _m, args, out, seen=seen: seen.update(x=args[0], y=out))
        logits[kernel] = decoder(ids, decoder.new_cache())
        assert torch.equal(seen["y"], reference_linear(seen["x"], wq, scale))
    assert torch.equal(logits["reference"], logits[default_int8_kernel()])  # exact kernels: the same bits


@pytest.mark.parametrize("draft", ["ngram", "layerskip"])
def test_speculative_greedy_equals_the_verifiers_own_greedy(tiny_int8_head_artifact, draft):
    engine = load(tiny_int8_head_artifact.path, backend="cpu")
    for prompt in PROMPTS:
        expected = engine.generate(prompt, max_new_tokens=24, draft="none").tokens
        assert engine.generate(prompt, max_new_tokens=24, draft=draft, num_draft=4).tokens == expected, prompt


def test_batched_verify_equals_each_sequence_alone(tiny_int8_head_artifact):
    decoder = tiny_int8_head_artifact.decoder()
    decoder.prepare("torch", default_int8_kernel(), fuse=True)
    prompts, blocks = [torch.tensor(ONNX_PROMPT), torch.tensor([9, 8, 7, 6])], [torch.tensor([3, 4, 5]), torch.tensor([11, 12])]
    solo, caches = [], []
    for prompt, block in zip(prompts, blocks):
        cache = decoder.new_cache()
        decoder(prompt, cache)
        solo.append(decoder(block, cache))
        cache.truncate(len(prompt))
        caches.append(cache)
    assert torch.equal(decoder.forward_blocks(blocks, caches), torch.cat(solo))


def test_static_head_takes_one_calibrated_scale(static_head, tiny_qwen3_tied):
    """The head's static scale is the largest |x| the float model's final norm gives on the calibration samples, / 127."""
    from quasar_deploy.calibration.data import calibration_samples
    from quasar_deploy.tokenizer import load_tokenizer

    scale = static_head.checkpoint.tensor("lm_head.input_scale")
    float_model = open_model_files(tiny_qwen3_tied).decoder()
    largest = []
    float_model.model.norm.register_forward_hook(lambda _m, _args, out: largest.append(out.abs().max()))
    samples = calibration_samples(
        load_tokenizer(open_model_files(tiny_qwen3_tied), False), None, FAST_CALIBRATION["num_samples"], FAST_CALIBRATION["seq_len"]
    )
    for sample in samples:
        float_model(torch.tensor(sample), float_model.new_cache(len(sample)))
    torch.testing.assert_close(scale, (max(largest) / QMAX).reshape(1), rtol=1e-6, atol=0)
    decoder = static_head.decoder()
    assert decoder.lm_head.quantized and torch.equal(decoder.lm_head.input_scale, scale)
    engine = load(static_head.path, backend="cpu")
    for prompt in PROMPTS:
        assert engine.generate(prompt, max_new_tokens=16, draft="ngram").tokens == engine.generate(prompt, max_new_tokens=16).tokens


@pytest.mark.parametrize("form", ["integer", "qdq"])
def test_onnx_export_runs_the_head_as_the_cpu_backend_does(tiny_int8_head_artifact, static_head, tmp_path, form):
    pytest.importorskip("onnxruntime")
    import onnx

    from quasar_deploy.backends.torch_backend import load_cpu
    from quasar_deploy.exporters import export

    from .helpers import decoder_graph, ort_session, run_full

    files = tiny_int8_head_artifact if form == "integer" else static_head
    out = export(files.path, "onnx", tmp_path / "onnx", linear_format=form)
    graph = onnx.load(str(out / "model.onnx")).graph
    ops = collections.Counter(node.op_type for node in graph.node)
    if form == "integer":  # q/k/v and gate/up run as one product each; the head is one of the products
        assert ops["MatMulInteger"] == 4 * files.spec.num_layers + 1
    else:
        assert ops["QuantizeLinear"] == 7 * files.spec.num_layers + 1
    assert not any(t.name.startswith("lm_head") and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 for t in graph.initializer)
    got = torch.from_numpy(run_full(ort_session(out / "model.onnx"), files.spec, ONNX_PROMPT))
    expected = load_cpu(files, int8_kernel="reference").verify(ONNX_PROMPT)
    assert (got - expected).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    in_memory = decoder_graph(files.decoder(), graph.name, form)
    assert [n.op_type for n in in_memory.graph.node] == [n.op_type for n in graph.node]  # streamed export = in-memory graph


def test_cuda_backend_binds_the_head_to_its_int8_kernel(tiny_int8_head_artifact):
    """Every quantized ``Linear`` goes through ``cuda_linear``, the head included (its code path runs on the CPU here)."""
    from quasar_deploy.backends import cuda as cuda_backend
    from quasar_deploy.backends.cuda_linear import Int8Linear

    head = cuda_backend.build_cuda_lm(tiny_int8_head_artifact, "cpu", "torch").decoder.lm_head
    assert isinstance(head._fn, Int8Linear) and head.weight.is_meta


def test_npu_export_refuses_an_int8_head(tiny_int8_head_artifact, tmp_path):
    from quasar_deploy.exporters import export

    with pytest.raises(QuasarError, match=r"has an int8 lm_head .* calibrate without --int8-lm-head for the npu target$"):
        export(tiny_int8_head_artifact.path, "npu", tmp_path / "npu")
    assert not (tmp_path / "npu").exists()


def test_inflated_int8_head_artifact_decodes_the_same_tokens(tiny_int8_head_artifact, tiny_qwen3_tied, tmp_path):
    from quasar_deploy.inflate import InflationTarget, inflate_artifact, inflate_checkpoint

    target = InflationTarget(hidden_size=128, intermediate_size=200, num_layers=4, num_heads=8, num_kv_heads=4)
    model = inflate_checkpoint(tiny_qwen3_tied, tmp_path / "float", target, progress=False)
    big = inflate_artifact(tiny_int8_head_artifact.path, tmp_path / "w8a8", target, model, progress=False)
    files = open_model_files(big)
    assert files.decoder().lm_head.quantized and "lm_head" in files.manifest["quantized_layers"]
    assert "lm_head" not in json.loads((big / "config.json").read_text())["quantization_config"]["ignore"]
    small_engine, big_engine = load(tiny_int8_head_artifact.path, backend="cpu"), load(big, backend="cpu")
    for prompt in PROMPTS:
        assert (
            small_engine.generate(prompt, max_new_tokens=24, draft="ngram").tokens
            == big_engine.generate(prompt, max_new_tokens=24, draft="ngram").tokens
        )


@pytest.mark.parametrize("fixture, head_targeted", [("tiny_artifact", False), ("tiny_int8_head_artifact", True)])
def test_compressed_tensors_targets_the_head_only_when_it_is_int8(request, fixture, head_targeted):
    """compressed-tensors' own matcher, on the transformers model of the artifact's config: every proj, and lm_head iff int8."""
    import transformers
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils import match_named_modules

    files = request.getfixturevalue(fixture)
    config = json.loads((files.path / "config.json").read_text())
    quantization = QuantizationConfig.model_validate(config.pop("quantization_config"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**config))
    targets = quantization.config_groups["group_0"].targets
    names = {name for name, _ in match_named_modules(model, targets, quantization.ignore)}
    assert names == set(files.manifest["quantized_layers"])
    assert ("lm_head" in names) is head_targeted
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is False  # an int8 head is never tied back
