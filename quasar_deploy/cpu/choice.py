"""Choosing the int8 kernel: one timing of every bit-exact int8 kernel here (and of ONNX Runtime's int8 linear, which
decides where ``auto`` runs an artifact), kept across processes.

The pick also decides whether ``auto`` runs an artifact on the cpu backend or ONNX Runtime, which round differently,
so a timing is kept per CPU, thread count and software and every process chooses alike (``QUASAR_REPROBE=1``: again).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .._version import __version__
from ..backends.ort_session import bit_exact_int8_entries, session_options, unavailable
from ..cache import cache_dir, read_json, write_json
from ..errors import QuasarError
from . import int8_linear as int8_kernel
from . import linears
from .linears import LinearFn
from .machine import cpu_model

REPROBE_ENV = "QUASAR_REPROBE"


def kept_path(key: dict) -> Path:
    """Where the timing for ``key`` is kept: beside the kernels built for this machine, one file per key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"probe-{key['probe']}-{digest}.json"


def recall(key: dict) -> tuple[dict, str] | None:
    """The result kept for ``key`` and when it was timed, or None (nothing valid kept, or ``QUASAR_REPROBE`` set)."""
    if os.environ.get(REPROBE_ENV):
        return None
    record = read_json(kept_path(key))
    if record.get("key") != key or not isinstance(record.get("result"), dict):
        return None
    return record["result"], str(record.get("date"))


def keep(key: dict, result: dict) -> str:
    """Keep ``result`` for ``key`` (the file replaced whole; a cache that cannot be written, skipped); when it was timed."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        write_json(kept_path(key), {"key": key, "result": result, "date": date})
    except OSError:
        pass
    return date


PROBE_ROWS = (6, 48)  # a verify block, and a batched serving step of 8 sequences
ONNXRUNTIME = "onnxruntime"  # ONNX Runtime's int8 linear in the probe's timings (not a kernel of the torch backend)
# how much faster than ONNX Runtime's int8 linear the torch backend's must time for the cpu backend to run artifacts:
# ORT's single graph costs less around its linears (docs/cpu-kinds.md)
ONNXRUNTIME_MARGIN = 1.25
BUSY_SHARE = 0.2  # of the CPUs' time other processes may take while the kernels are timed for the timing to be kept
MIN_JUDGED_S = 0.2  # a timing shorter than this is not judged busy or quiet: /proc/stat counts in 10 ms ticks


@dataclass(frozen=True)
class Int8Probe:
    """What timing the bit-exact int8 kernels showed (``int8_probe``): per kernel, ms of a call at each of ``PROBE_ROWS``, summed."""

    ms: dict[str, float]
    timed: str | None = None  # when it was timed (UTC), here or by an earlier process (``recall``); None: not timed
    busy: float | None = None  # the share of the CPUs other processes took while it was timed, when too much to keep it

    @property
    def kernel(self) -> str:
        """The fastest bit-exact kernel of the torch backend; with none here, the reference."""
        ours = {name: ms for name, ms in self.ms.items() if name != ONNXRUNTIME}
        return min(ours, key=ours.__getitem__) if ours else "reference"

    @property
    def cpu_beats_onnxruntime(self) -> bool:
        """Whether ours timed ``ONNXRUNTIME_MARGIN`` times faster than ORT's int8 linear (true where ORT was not timed)."""
        return ONNXRUNTIME not in self.ms or self.ms[self.kernel] * ONNXRUNTIME_MARGIN <= self.ms[ONNXRUNTIME]

    @property
    def reason(self) -> str:
        if not self.ms:
            return "no bit-exact int8 kernel but the reference here (no FBGEMM, and no build of ours runs)"
        if len(self.ms) == 1:
            return "the only bit-exact int8 kernel here"
        times = ", ".join(f"{name} {ms:.2f} ms" for name, ms in self.ms.items())
        if self.busy is not None:
            when = f"; timed while other processes took {self.busy:.0%} of the CPUs: not kept, the next process times again"
        elif self.timed:
            when = f"; timed {self.timed}, kept: {REPROBE_ENV}=1 times again"
        else:
            when = ""
        ort = "" if self.cpu_beats_onnxruntime else f"; ours not {ONNXRUNTIME_MARGIN}x faster than ONNX Runtime's: W8A8 artifacts run there"
        return f"the fastest at {' and '.join(map(str, PROBE_ROWS))} rows ({times}{when}){ort}"


PROBE_SHAPE = (4096, 2048)  # (out, in) of the probe's weight: 8 MB, a 1.7B model's attention projection
PROBE_COPIES = 6  # packed copies of it timed in turn: 48 MB, more than a server CPU's last-level cache


@functools.cache
def int8_probe() -> Int8Probe:
    """Times the bit-exact int8 kernels here once per machine, interleaved, each on ``PROBE_COPIES`` packed copies of a
    verify-step linear (more than a cache holds: weights come from memory); the timing is kept (``keep``)."""
    kernels = int8_kernels_to_time()
    if len(kernels) < 2:
        return Int8Probe({name: 0.0 for name in kernels})
    key = _int8_probe_key(kernels)
    kept = recall(key)
    if kept is not None and set(kept[0]) == set(kernels):
        return Int8Probe({name: float(kept[0][name]) for name in kernels}, kept[1])
    ms, busy = _timed_beside_others(kernels)
    if busy is not None and busy > BUSY_SHARE:  # a busy machine's timing can invert the order: this process alone uses it
        return Int8Probe(ms, busy=busy)
    return Int8Probe(ms, keep(key, ms))


def int8_kernels_to_time() -> list[str]:
    """The int8 kernels ``int8_probe`` times here: those that sum in 32 bits, ``quasar`` where it runs, FBGEMM's split one
    where its own saturates; and ONNX Runtime's integer-exact ``MatMulInteger`` (``ONNXRUNTIME``, weighed by the backend choice)."""
    offered = (
        ("fbgemm-vnni", linears.vnni_available()),
        ("onednn-vnni", linears.onednn_int8_bit_exact()),
        ("quasar", linears.quasar_int8_available()),
        ("fbgemm", linears.fbgemm_available() and not linears.vnni_available()),
    )
    kernels = [name for name, here in offered if here]
    return [*kernels, ONNXRUNTIME] if kernels and onnxruntime_int8_bit_exact() else kernels


@functools.cache
def onnxruntime_int8_bit_exact() -> bool:
    """Whether ONNX Runtime is installed and its CPU ``MatMulInteger`` sums exactly here (with or without options)."""
    if unavailable() is not None:
        return False
    try:
        bit_exact_int8_entries()
    except QuasarError:
        return False
    return True


def _int8_probe_key(kernels: list[str]) -> dict:
    """What the int8 timing depends on: the CPU, the threads, the software, our kernel's source and build."""
    return {
        "probe": "int8",
        "kernels": kernels,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "quasar_deploy": __version__,
        "kernel_source": hashlib.sha256(int8_kernel.SOURCE.read_bytes()).hexdigest()[:16],
        "kernel_build": int8_kernel.build(),  # the AMX build or the vector one: they time apart
        "onnxruntime": _onnxruntime_version() if ONNXRUNTIME in kernels else None,
        "shape": [*PROBE_SHAPE, PROBE_COPIES, *PROBE_ROWS],
    }


def _onnxruntime_version() -> str:
    import onnxruntime  # optional: onnxruntime (an int8 kernel here only where installed)

    return onnxruntime.__version__


def _time_int8_kernels(kernels: list[str]) -> dict[str, float]:
    """``int8_probe``'s timing, ms per kernel: the fastest of four interleaved rounds, summed over ``PROBE_ROWS``."""
    generator = torch.Generator().manual_seed(0)
    wq = torch.randint(-127, 128, PROBE_SHAPE, generator=generator, dtype=torch.int8)
    w_scale = torch.full((PROBE_SHAPE[0], 1), 0.01)
    x = torch.randn(max(PROBE_ROWS), PROBE_SHAPE[1], generator=generator)
    chains = {name: [_probe_linear(wq, w_scale, name) for _ in range(PROBE_COPIES)] for name in kernels}
    best = {(name, rows): float("inf") for name in kernels for rows in PROBE_ROWS}
    for _ in range(4):  # the first round warms up; the fastest of the rounds counts
        for (name, rows), ms in best.items():
            best[name, rows] = min(ms, _chain_ms(chains[name], x[:rows]))
    return {name: sum(best[name, rows] for rows in PROBE_ROWS) for name in kernels}


def _timed_beside_others(kernels: list[str]) -> tuple[dict[str, float], float | None]:
    """``_time_int8_kernels(kernels)``, and the share of the CPUs' time other processes took meanwhile (None: not known)."""
    before, own, began = _cpu_seconds_busy(), time.process_time(), time.perf_counter()
    ms = _time_int8_kernels(kernels)
    elapsed, after = time.perf_counter() - began, _cpu_seconds_busy()
    if before is None or after is None or elapsed < MIN_JUDGED_S:
        return ms, None
    others = after[0] - before[0] - (time.process_time() - own)  # our own threads' time is the timing itself
    return ms, max(0.0, others) / (elapsed * after[1])


def _cpu_seconds_busy() -> tuple[float, int] | None:
    """Seconds all CPUs here have been busy since boot, and how many there are (Linux's /proc/stat); None elsewhere."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        ticks = [int(field) for field in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return None
    cpus = sum(line.startswith("cpu") and line[3:4].isdigit() for line in lines)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), max(cpus, 1)


def _probe_linear(wq: torch.Tensor, w_scale: torch.Tensor, name: str) -> LinearFn:
    return _onnxruntime_int8(wq, w_scale) if name == ONNXRUNTIME else linears.int8_linear(wq, w_scale, None, None, name)


def _chain_ms(linears: list[LinearFn], rows: torch.Tensor) -> float:
    start = time.perf_counter()
    for linear in linears:
        linear(rows)
    return (time.perf_counter() - start) * 1e3


def default_int8_kernel(device: str = "cpu") -> str:
    """The fastest bit-exact int8 kernel here (``int8_probe``); ``reference`` off the CPU."""
    return int8_probe().kernel if device == "cpu" else "reference"


def _onnxruntime_int8(wq, w_scale) -> LinearFn:
    """The scheme's W8A8 linear in ONNX Runtime's integer graph (``onnx_graph.w8a8_linear``), for ``int8_probe`` to time."""
    import onnxruntime as ort  # optional: onnxruntime
    from onnx import TensorProto, helper  # optional: onnx

    from ..exporters.onnx_graph import GraphBuilder, w8a8_linear  # optional: onnx

    g = GraphBuilder("integer")
    y = w8a8_linear(g, "x", wq.numpy(), w_scale.float().numpy(), None, "probe")
    model = g.model(
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, wq.shape[1]])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [None, wq.shape[0]])],
    )
    options = session_options(torch.get_num_threads(), fixed_shape=True)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
