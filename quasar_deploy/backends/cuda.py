"""The cuda backend: our decoder on an NVIDIA GPU, W8A8 linears on int8 tensor cores, float parts in bf16, steps as CUDA graphs.

The cpu backend's ``model.Decoder`` moved to the GPU once, ``cuda_linear.device_kernels`` bound; decode and verify
blocks replay CUDA graphs of ``static_decode.static_forward``. ``build_cuda_lm`` takes the device, so tests run on CPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..artifact import ModelFiles
from ..errors import QuasarError
from ..model import Decoder, Linear
from .cuda_linear import IntMMRules, Quantizer, device_kernels, quantize_rows_torch
from .static_decode import BLOCK_ROWS, GraphedSteps, StaticCache, static_forward
from .torch_backend import TorchCausalLM

MIN_CAPABILITY = (7, 5)  # Turing: the first GPUs whose tensor cores run int8 (cuBLASLt's IMMA kernels behind torch._int_mm)
QUANTIZERS = ("triton", "torch")


def unavailable() -> str | None:
    """Why the cuda backend cannot run here, in one line (None: it can)."""
    if torch.version.cuda is None:
        return f"this PyTorch build ({torch.__version__}) has no CUDA support (install a CUDA build of PyTorch)"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "no GPU visible to torch (check the NVIDIA driver and CUDA_VISIBLE_DEVICES)"
    capability = torch.cuda.get_device_capability(0)
    if capability < MIN_CAPABILITY:
        return (
            f"{torch.cuda.get_device_name(0)} has compute capability {capability[0]}.{capability[1]}: no int8 tensor cores "
            f"(needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, Turing, or newer)"
        )
    return None


def gpu_status() -> dict:
    """What ``doctor`` shows: the GPU, its compute capability, whether int8 tensor cores are usable, else why not."""
    status: dict = {"reason": unavailable()}
    if torch.version.cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        major, minor = torch.cuda.get_device_capability(0)
        status.update(
            gpu=torch.cuda.get_device_name(0),
            compute_capability=f"{major}.{minor}",
            int8_tensor_cores=(major, minor) >= MIN_CAPABILITY,
            cuda=torch.version.cuda,
        )
    status["triton"] = importlib.util.find_spec("triton") is not None
    return status


def make_quantizer(name: str, device: torch.device) -> Quantizer:
    """The activation quantization: the fused Triton kernel (CUDA only) or the plain-torch one."""
    if name not in QUANTIZERS:
        raise QuasarError(f"quantizer must be one of {', '.join(QUANTIZERS)}, not {name!r}")
    if name == "torch":
        return quantize_rows_torch
    if device.type != "cuda":
        raise QuasarError("the triton quantizer runs on CUDA devices only")
    if importlib.util.find_spec("triton") is None:
        raise QuasarError("the triton quantizer needs Triton (it ships with CUDA builds of PyTorch); use quantizer='torch'")
    from .cuda_triton import quantize_rows_triton  # optional: triton

    return quantize_rows_triton


def bind_device_kernels(decoder: Decoder, device: torch.device, quantize: Quantizer) -> None:
    """Move ``decoder`` to ``device`` (each weight once) and bind the device kernels, q/k/v and gate/up fused."""
    decoder.move_to(device)
    kernels = device_kernels(IntMMRules.for_device(device), quantize)
    decoder.fuse(kernels)
    for module in decoder.modules():
        if isinstance(module, Linear) and not module.weight.is_meta:
            module.bind(kernels(*module.tensors()))
            module.release_weight()


class CudaCausalLM(TorchCausalLM):
    """``TorchCausalLM`` over a ``Decoder`` with device kernels: a ``StaticCache`` per sequence, CUDA graphs for short blocks on CUDA."""

    def __init__(self, decoder: Decoder, max_length: int | None = None, graphs: bool = True, description: str = ""):
        super().__init__(decoder, max_length, description)
        self.graphs = GraphedSteps(decoder, self.cache) if graphs and self._device.type == "cuda" else None

    def _new_cache(self) -> StaticCache:
        return StaticCache(self.spec, self.decoder.dtype, self._device, self.max_length)

    def _run(self, ids: Sequence[int], skip_layers: frozenset[int] = frozenset()) -> torch.Tensor:
        tokens = self._ids(ids)
        t = len(ids)
        start, end = self.cache.length, self.cache.length + t
        rows = max(t, BLOCK_ROWS)  # a decode or verify block runs as BLOCK_ROWS rows (static_decode.py says why)
        if self.cache.make_room(start + rows) and self.graphs is not None:
            self.graphs.clear()
        span = self.cache.span(end)
        tokens = F.pad(tokens, (0, rows - t))
        if self.graphs is not None and rows == BLOCK_ROWS and not skip_layers:
            logits = self.graphs.run(tokens, start, span)
        else:
            position = torch.full((1,), start, dtype=torch.long, device=self._device)
            logits = static_forward(self.decoder, self.cache, tokens, position, span, skip_layers)
        self.cache.length = end
        return logits[:t]

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        self.cache.truncate(0)
        return self._run(ids)[-1]

    def verify(self, ids: Sequence[int]) -> torch.Tensor:
        return self._run(ids)

    def verify_skipping(self, ids: Sequence[int], skip_layers: frozenset[int]) -> torch.Tensor:
        """Eager (no graph): the layer-skipping drafter's steps change their skipped set."""
        return self._run(ids, skip_layers)

    def new_sequence(self) -> CudaCausalLM:
        """The same decoder and kernels with a fresh cache and its own graphs."""
        return CudaCausalLM(self.decoder, self.max_length, self.graphs is not None, self.description)


def build_cuda_lm(
    files: ModelFiles, device: torch.device | str, quantizer_name: str = "triton", graphs: bool = True, max_length: int | None = None
) -> CudaCausalLM:
    """The backend on ``device``; the tests pass ``cpu`` (with the torch quantizer) to run this code path without a GPU."""
    device = torch.device(device)
    quantize = make_quantizer(quantizer_name, device)
    decoder = files.decoder(torch.bfloat16)
    bind_device_kernels(decoder, device, quantize)
    kind = f"W8A8 ({files.scheme.activation} activations, int8 tensor cores)" if files.is_artifact else "float (bf16 cuBLAS)"
    steps = "CUDA graphs" if graphs and device.type == "cuda" else "eager"
    return CudaCausalLM(decoder, max_length, graphs, description=f"cuda {kind}, bf16, {quantizer_name} quantizer, {steps}")


def load_cuda(
    files: ModelFiles, quantizer: str = "triton", graphs: bool = True, max_length: int | None = None, device: int = 0
) -> CudaCausalLM:
    """W8A8 artifact (or float checkpoint) on CUDA GPU ``device``; ``quantizer='torch'`` and ``graphs=False`` are for diagnosis."""
    reason = unavailable()
    if reason is not None:
        raise QuasarError(f"backend 'cuda' cannot run here: {reason}")
    return build_cuda_lm(files, torch.device("cuda", device), quantizer, graphs, max_length)
