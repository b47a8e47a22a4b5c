"""The backends users can pick, by name, and the factory that builds one.

Each entry names its factory and availability check as ``"module:callable"``, imported on first use (no torch).
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cpu import machine
from ..errors import QuasarError
from ..integrity import export_target
from ..lazy import resolve

if TYPE_CHECKING:
    from ..artifact import ModelFiles
    from ..speculative.causal_lm import CausalLM


@dataclass(frozen=True)
class BackendEntry:
    """``factory(files, **options)`` builds the ``CausalLM`` of opened ``ModelFiles``; ``unavailable()`` is None where it can run,
    else why not; ``provides``: what it offers beyond a plain ``CausalLM`` (``CAPABILITIES``), which "auto" matches to needs."""

    factory: str
    unavailable: str
    provides: frozenset[str] = frozenset()


# what a caller may need of a backend: "layer_skip" (``LayerSkippingLM``, for the layerskip drafter)
CAPABILITIES = ("layer_skip",)
TORCH_DECODER = frozenset({"layer_skip"})


def draft_needs(draft: str) -> tuple[str, ...]:
    """What decoding with the drafter named ``draft`` needs of a backend (``load(path, needs=...)``)."""
    return ("layer_skip",) if draft == "layerskip" else ()


BACKENDS: dict[str, BackendEntry] = {
    "cuda": BackendEntry("quasar_deploy.backends.cuda:load_cuda", "quasar_deploy.backends.cuda:unavailable", TORCH_DECODER),
    "cpu": BackendEntry("quasar_deploy.backends.torch_backend:load_cpu", "quasar_deploy.backends.torch_backend:unavailable", TORCH_DECODER),
    "npu": BackendEntry("quasar_deploy.backends.npu:load_npu", "quasar_deploy.backends.npu:unavailable", TORCH_DECODER),
    "onnxruntime": BackendEntry(
        "quasar_deploy.backends.onnxruntime:load_onnx", "quasar_deploy.backends.onnxruntime:unavailable", frozenset({"layer_skip"})
    ),
}

# "auto" takes the first of these that can run here, provides what the caller needs, and (ONNX Runtime) suits the model
# (``suits_onnxruntime``; docs/architecture.md, "Choosing the backend")
AUTO_ORDER = ("cuda", "onnxruntime", "cpu")
# ORT's session build of a graph holding its weights inside (older cached exports) peaks at about twice what it then
# holds: "auto" picks ORT only where twice the cpu backend's estimate fits in MemAvailable
ONNXRUNTIME_MEMORY_FACTOR = 2
# export target (``quasar-export.json``) -> the backend that runs it; targets missing here are other runtimes' to serve
EXPORT_BACKENDS = {"onnx": "onnxruntime"}
# backend -> its factory of an export, which takes the export's directory (no ``ModelFiles`` opens an export)
EXPORT_FACTORIES = {"onnxruntime": "quasar_deploy.backends.onnxruntime:load_onnx_export"}
# files that mark an export whose manifest is missing (a partial copy): routed as their target, whose loader then explains
EXPORT_MARKERS = {"genai_config.json": "onnx", "quant_model_description.json": "npu"}


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here, in one line (None: it can)."""
    return resolve(BACKENDS[name].unavailable)()


def available_backends() -> dict[str, str | None]:
    """Every registered backend and why it cannot run here (None: it can)."""
    return {name: unavailable(name) for name in BACKENDS}


def _check_needs(needs: Collection[str]) -> frozenset[str]:
    unknown = sorted(set(needs) - set(CAPABILITIES))
    if unknown:
        raise QuasarError(f"unknown backend capability {unknown[0]!r}; choose from {', '.join(CAPABILITIES)}")
    return frozenset(needs)


def options_of(name: str) -> list[str]:
    """The options backend ``name``'s factory takes (besides the model)."""
    return list(inspect.signature(resolve(BACKENDS[name].factory)).parameters)[1:]


def candidates(needs: Collection[str] = (), options: Collection[str] = ()) -> list[str]:
    """The backends of ``AUTO_ORDER`` that can run here, provide ``needs`` and take ``options``, best first."""
    wanted = _check_needs(needs)
    return [
        n
        for n in AUTO_ORDER
        if wanted <= BACKENDS[n].provides and unavailable(n) is None and (not options or set(options) <= set(options_of(n)))
    ]


def fits_onnxruntime(files: ModelFiles) -> bool:
    """Whether ONNX Runtime's copy of the model ``files`` fits in the memory available now (``ONNXRUNTIME_MEMORY_FACTOR``)."""
    from ..memory import estimate, report_tokens  # keeps --help torch-free (memory reads safetensors through torch)

    needed = estimate(files).total(report_tokens(files.spec))
    return needed * ONNXRUNTIME_MEMORY_FACTOR <= machine.memory_available()


def cpu_runs_better(artifact: bool) -> bool:
    """Whether the cpu backend runs a W8A8 artifact (``artifact``: our int8 kernel timed faster than ORT's) or a float
    checkpoint (where the CPU computes bf16; ORT computes float32) better than ONNX Runtime here."""
    from ..cpu.choice import default_int8_kernel, int8_probe  # keeps --help torch-free
    from ..cpu.linears import cpu_computes_bf16  # keeps --help torch-free

    if not artifact:
        return cpu_computes_bf16()
    return default_int8_kernel("cpu") == "quasar" and int8_probe().cpu_beats_onnxruntime


def auto_choice(artifact: bool, needs: Collection[str] = ()) -> str:
    """The backend "auto" gives a W8A8 artifact (``artifact``) or a float checkpoint here, before its memory check; with
    ``needs``, a float checkpoint has no ONNX Runtime form that provides them (``doctor`` prints both)."""
    names = candidates(needs)
    if names[0] == "onnxruntime" and (cpu_runs_better(artifact) or (needs and not artifact)):
        return next(n for n in names if n != "onnxruntime")
    return names[0]


def suits_onnxruntime(files: ModelFiles, needs: Collection[str] = ()) -> bool:
    """ONNX Runtime's copy fits in memory, the cpu backend would not serve it better, and (``needs``) layer graphs run it."""
    if cpu_runs_better(files.is_artifact):
        return False
    if needs:
        from .onnx_layered import unsupported  # optional: onnx

        if unsupported(files) is not None:
            return False
    return fits_onnxruntime(files)


def auto_backend(files: ModelFiles, needs: Collection[str] = (), options: Collection[str] = ()) -> str:
    """The first of ``candidates(needs, options)`` for the opened model ``files``, ONNX Runtime only where ``suits_onnxruntime``."""
    names = candidates(needs, options) or candidates(needs)  # none here takes the options: they are refused by name later
    # an option only ONNX Runtime takes (a provider) asks for it, even where the cpu backend would run the model better
    return next((n for n in names if n != "onnxruntime" or suits_onnxruntime(files, needs)), names[0])


def export_backend(name: str, directory: Path) -> str | None:
    """The backend ``name`` (for "auto": the export's target's; ONNX: onnxruntime, NPU: vLLM-Ascend's, refused) where it runs
    ``directory`` as an export (``create_export_backend``); None: ``directory`` is opened as a model (``ModelFiles``)."""
    if name not in ("auto", *EXPORT_FACTORIES):
        return None
    target = export_target(directory) or next((t for marker, t in EXPORT_MARKERS.items() if (directory / marker).is_file()), None)
    if target is None:
        return None
    if name != "auto":
        return name
    if target == "npu":
        raise QuasarError(
            f"{directory}: an NPU export (msModelSlim layout) is served by vLLM-Ascend (docs/npu.md); "
            "to run on an NPU with quasar-deploy, load the artifact it came from with backend 'npu'"
        )
    if target not in EXPORT_BACKENDS:
        raise QuasarError(f"{directory}: a {target!r} export, which no backend of this quasar-deploy runs")
    return EXPORT_BACKENDS[target]


def resolve_backend(name: str, files: ModelFiles, needs: Collection[str] = (), options: Collection[str] = ()) -> str:
    """``name``, or for "auto" the backend ``auto_backend`` chooses for ``files``, ``needs`` and ``options``."""
    return auto_backend(files, needs, options) if name == "auto" else name


def create_backend(name: str, files: ModelFiles, needs: Collection[str] = (), **options: Any) -> CausalLM:
    """The opened model ``files`` on backend ``name`` ("auto": ``auto_backend``), providing ``needs`` (told to a factory taking them)."""
    name = resolve_backend(name, files, needs, options)
    options = factory_options(name, needs, options)  # before the lookup: an unknown name is one line
    return resolve(BACKENDS[name].factory)(files, **options)


def create_export_backend(name: str, directory: Path, needs: Collection[str] = (), **options: Any) -> CausalLM:
    """The export at ``directory`` on backend ``name`` (``export_backend``), which reads the directory itself."""
    options = factory_options(name, needs, options)
    return resolve(EXPORT_FACTORIES[name])(directory, **options)


def factory_options(name: str, needs: Collection[str], options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for backend ``name``'s factory (``needs`` added where it takes them), once it runs here and takes them all."""
    if name not in BACKENDS:
        raise QuasarError(f"unknown backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    reason = unavailable(name)
    if reason is not None:
        raise QuasarError(f"backend {name!r} cannot run here: {reason}")
    takes = options_of(name)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise QuasarError(f"backend {name!r} takes no option {unknown[0]!r} (it takes {', '.join(takes)})")
    return {**options, "needs": tuple(_check_needs(needs))} if needs and "needs" in takes else options
