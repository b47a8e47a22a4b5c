"""The GPU measurements (``quasar-deploy bench gpu``, ``tools/gpu_check.sh``): one run, one table.

Every ratio is the cuda backend's W8A8 path against its bf16 path (cuBLAS, same CUDA graphs), in one process: the verify
step beside the ideal bytes ratio, GEMMs against the copy bandwidth (CUDA graphs over weight copies streaming from HBM, not
L2), n-gram drafting end to end on the demo model and a synthetic shape."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..artifact import open_model_files
from ..backends.cuda import CudaCausalLM, bind_device_kernels, build_cuda_lm, make_quantizer, unavailable
from ..backends.cuda_linear import CUDA_RULES
from ..calibration.data import BUILTIN
from ..demo import demo_artifact, demo_model_path
from ..engine import Engine
from ..errors import QuasarError
from ..tokenizer import load_tokenizer
from .contenders import Contenders
from .e2e import BenchSettings, benchmark
from .gpu_settings import GpuSettings
from .micro import weight_bytes
from .record import INT8, make_record
from .synthetic import synthetic_decoders

GEMM_SHAPE = (12288, 4096)  # Qwen3-8B's gate/up: out x in
STREAM_BYTES = 1 << 30  # weight copies cycled per timing: far beyond any L2
GPU_DTYPES = {"float": "bfloat16", "w8a8": f"{INT8}, bfloat16 lm_head"}


def require_cuda() -> torch.device:
    """The GPU, or a one-line refusal naming why the cuda backend cannot run here."""
    reason = unavailable()
    if reason is not None:
        raise QuasarError(f"bench gpu needs the cuda backend: {reason}")
    return torch.device("cuda", 0)


def _synced_seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _graph_seconds(fn, repeats: int = 5) -> float:
    """Best GPU time of ``fn`` captured once as a CUDA graph (no launch overhead in the figure)."""
    fn()  # warm-up: cuBLAS workspaces, heuristics
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1000)
    return min(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.ones(STREAM_BYTES // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * STREAM_BYTES / _graph_seconds(lambda: dst.copy_(src))


def gemm_bandwidth(device: torch.device, rows: tuple[int, ...], shape: tuple[int, int] = GEMM_SHAPE) -> dict:
    """int8 ``_int_mm`` and bf16 ``F.linear`` at each M: weight bytes read per second, against the copy bandwidth."""
    out_features, in_features = shape
    copies = max(2, STREAM_BYTES // (out_features * in_features))
    int8_weights = [torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, device=device) for _ in range(copies)]
    bandwidth = copy_bandwidth(device)
    results = []
    for m in rows:
        padded_rows, _ = CUDA_RULES.padded(m, in_features)
        q = torch.randint(-127, 128, (padded_rows, in_features), dtype=torch.int8, device=device)
        int8_s = _graph_seconds(lambda q=q: [torch._int_mm(q, w.t()) for w in int8_weights]) / copies
        results.append(
            {"m": m, "gemm_rows": padded_rows, "int8_ms": 1000 * int8_s, "int8_fraction": out_features * in_features / int8_s / bandwidth}
        )
    int8_weights.clear()  # room for the bf16 copies
    float_copies = max(2, copies // 2)
    float_weights = [torch.randn(out_features, in_features, dtype=torch.bfloat16, device=device) for _ in range(float_copies)]
    for row in results:
        x = torch.randn(row["m"], in_features, dtype=torch.bfloat16, device=device)
        bf16_s = _graph_seconds(lambda x=x: [F.linear(x, w) for w in float_weights]) / float_copies
        row.update(bf16_ms=1000 * bf16_s, bf16_fraction=2 * out_features * in_features / bf16_s / bandwidth)
    return {"shape": list(shape), "copy_bandwidth_gb_s": bandwidth / 1e9, "rows": results}


def synthetic_lms(shape: str, device: torch.device, max_length: int, quantizer: str):
    """(bf16 lm, W8A8 lm, ideal bytes ratio) of a synthetic shape on the cuda backend, weights drawn on the GPU."""
    float_model, quant_model = synthetic_decoders(shape, dtype=torch.bfloat16, device=device)
    ideal = weight_bytes(float_model) / weight_bytes(quant_model)
    quantize = make_quantizer(quantizer, device)
    lms = []
    for decoder, kind in ((float_model, "bf16"), (quant_model, "W8A8")):
        bind_device_kernels(decoder, device, quantize)
        lms.append(CudaCausalLM(decoder, max_length, description=f"cuda {kind} synthetic {shape}"))
    return lms[0], lms[1], ideal


def verify_step(shape: str, settings: GpuSettings, device: torch.device) -> dict:
    """One k+1-token verify forward on a warm ``context``-token cache, bf16 vs W8A8, interleaved pairs (CUDA graphs)."""
    float_lm, quant_lm, ideal = synthetic_lms(shape, device, settings.context + settings.tokens, settings.quantizer)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, float_lm.vocab_size, (settings.context,), generator=generator).tolist()
    block = torch.randint(0, float_lm.vocab_size, (settings.tokens,), generator=generator).tolist()

    def step(lm) -> float:
        lm.truncate(settings.context)
        return _synced_seconds(lambda: lm.verify(block))

    for lm in (float_lm, quant_lm):
        lm.prefill(prompt)
        step(lm)  # captures the graph
        step(lm)
    pairs = [(step(float_lm), step(quant_lm)) for _ in range(settings.repeats)]
    ratios = [f / q for f, q in pairs]
    return {
        "shape": shape,
        "tokens": settings.tokens,
        "context": settings.context,
        "bf16_ms": 1000 * statistics.median(f for f, _ in pairs),
        "w8a8_ms": 1000 * statistics.median(q for _, q in pairs),
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "ideal_ratio": ideal,
    }


def _ngram_benchmark(label: str, float_lm, quant_lm, tokenizer, weights: str, settings: GpuSettings) -> dict:
    engines = [Engine(lm, tokenizer, frozenset(), "cuda") for lm in (float_lm, quant_lm)]
    bench = BenchSettings(
        prompts=str(BUILTIN["prompts"]),
        limit=settings.prompts,
        max_new_tokens=settings.max_new_tokens,
        num_draft=settings.num_draft,
        modes=("ngram-float", "ngram-w8a8"),
    )
    modes = benchmark(bench, Contenders(lambda: (engines[0], engines[1]), tokenizer, frozenset(), None, weights), progress=False)["modes"]
    return {
        "model": label,
        "weights": weights,
        "bf16_tokens_per_s": modes["ngram-float"]["tokens_per_s"],
        "w8a8_tokens_per_s": modes["ngram-w8a8"]["tokens_per_s"],
        "ratio": modes["ngram-w8a8"]["speedup_vs_ngram-float"],
        "acceptance_bf16": modes["ngram-float"]["acceptance_length"],
        "acceptance_w8a8": modes["ngram-w8a8"]["acceptance_length"],
    }


def e2e_demo(settings: GpuSettings, device: torch.device) -> dict:
    """n-gram on the shipped demo model: its float checkpoint (bf16) vs its W8A8 artifact (calibrated once, cached)."""
    plain = open_model_files(demo_model_path())
    float_lm = build_cuda_lm(plain, device, settings.quantizer)
    quant_lm = build_cuda_lm(open_model_files(demo_artifact(progress=False)), device, settings.quantizer)
    return _ngram_benchmark("demo", float_lm, quant_lm, load_tokenizer(plain), "trained", settings)


def e2e_synthetic(settings: GpuSettings, device: torch.device) -> dict:
    float_lm, quant_lm, _ = synthetic_lms(settings.e2e_shape, device, 4096, settings.quantizer)
    tokenizer = load_tokenizer(open_model_files(demo_model_path()))
    return _ngram_benchmark(settings.e2e_shape, float_lm, quant_lm, tokenizer, "synthetic weights", settings)


def run(settings: GpuSettings, log=print) -> dict:
    """Every measurement of the table, in one process; ``log`` hears each stage as it starts."""
    device = require_cuda()
    result = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "settings": asdict(settings)}
    log("int8 GEMM bandwidth ...")
    result["gemm"] = gemm_bandwidth(device, settings.rows)
    result["verify"] = []
    for shape in settings.shapes:
        log(f"verify step {shape} ...")
        result["verify"].append(verify_step(shape, settings, device))
        torch.cuda.empty_cache()
    log("end to end: demo model ...")
    result["e2e"] = [e2e_demo(settings, device)]
    torch.cuda.empty_cache()
    log(f"end to end: {settings.e2e_shape} ...")
    result["e2e"].append(e2e_synthetic(settings, device))
    return result


def _columns(rows: list[dict], columns: list[tuple[str, str, object]]) -> list[str]:
    """A header and one line per row; each column is (title, format spec such as ">8", row -> text)."""
    lines = [" ".join(f"{title:{spec}}" for title, spec, _ in columns)]
    return lines + [" ".join(f"{value(r):{spec}}" for _, spec, value in columns) for r in rows]


def table(result: dict) -> str:
    """The one table the device check prints (pure: tested on CPU with a recorded result)."""
    s = result["settings"]
    gemm = result["gemm"]
    out_features, in_features = gemm["shape"]
    return "\n".join(
        [
            f"GPU: {result['gpu']} (torch {result['torch']}); W8A8 against bf16 on the cuda backend, both with CUDA graphs",
            "",
            f"verify step: {s['tokens']} tokens on a warm {s['context']}-token cache, synthetic weights, "
            f"median of {s['repeats']} interleaved pairs",
            *_columns(
                result["verify"],
                [
                    ("shape", "<14", lambda r: r["shape"]),
                    ("bf16 ms", ">8", lambda r: f"{r['bf16_ms']:.3f}"),
                    ("W8A8 ms", ">8", lambda r: f"{r['w8a8_ms']:.3f}"),
                    ("speed-up", ">9", lambda r: f"{r['ratio']:.2f}x"),
                    ("range", ">11", lambda r: "{:.2f}-{:.2f}".format(*r["ratio_range"])),
                    ("ideal", ">6", lambda r: f"{r['ideal_ratio']:.2f}x"),
                    ("of ideal", ">8", lambda r: f"{100 * r['ratio'] / r['ideal_ratio']:.0f}%"),
                ],
            ),
            "",
            f"GEMM {out_features}x{in_features}, weight bytes/s as a share of the copy bandwidth ({gemm['copy_bandwidth_gb_s']:.0f} GB/s)",
            *_columns(
                gemm["rows"],
                [
                    ("M", ">3", lambda r: str(r["m"])),
                    ("int8 rows", ">9", lambda r: str(r["gemm_rows"])),
                    ("int8 ms", ">8", lambda r: f"{r['int8_ms']:.4f}"),
                    ("int8 %bw", ">8", lambda r: f"{100 * r['int8_fraction']:.0f}%"),
                    ("bf16 ms", ">8", lambda r: f"{r['bf16_ms']:.4f}"),
                    ("bf16 %bw", ">8", lambda r: f"{100 * r['bf16_fraction']:.0f}%"),
                ],
            ),
            "",
            f"end to end: n-gram drafter (k={s['num_draft']}), {s['prompts']} built-in prompts, {s['max_new_tokens']} new tokens, greedy",
            *_columns(
                result["e2e"],
                [
                    ("model", "<14", lambda r: r["model"]),
                    ("weights", "<18", lambda r: r["weights"]),
                    ("bf16 tok/s", ">10", lambda r: f"{r['bf16_tokens_per_s']:.1f}"),
                    ("W8A8 tok/s", ">10", lambda r: f"{r['w8a8_tokens_per_s']:.1f}"),
                    ("speed-up", ">9", lambda r: f"{r['ratio']:.2f}x"),
                    ("accept bf16/W8A8", ">17", lambda r: f"{r['acceptance_bf16']:.2f}/{r['acceptance_w8a8']:.2f}"),
                ],
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m quasar_deploy.bench.gpu``: the table with default settings, for machines without click (tools/gpu_check.sh)."""
    parser = argparse.ArgumentParser(prog="python -m quasar_deploy.bench.gpu", description=main.__doc__)
    parser.add_argument("--quantizer", choices=("triton", "torch"), default="triton")
    parser.add_argument("--json-out", help="Also write the result as a bench record (JSON, as `bench gpu --json` prints) to this file.")
    args = parser.parse_args(argv)
    try:
        settings = GpuSettings(quantizer=args.quantizer)
        result = run(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
    except QuasarError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(table(result))
    if args.json_out:
        record = make_record("bench gpu", asdict(settings), GPU_DTYPES, result)
        with open(args.json_out, "w", encoding="utf-8") as out:
            json.dump(record, out, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
