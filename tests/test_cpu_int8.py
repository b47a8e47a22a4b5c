"""Our int8 kernel (``cpu/int8_linear.c``: AMX tiles, AVX-512 VNNI, AVX-VNNI and AVX2 builds): bit for bit the
scheme's reference linear at any shape, a row alone or in company and however the columns are shared between threads,
on every build that runs here (the AVX2 build on every x86 CPU); and offered only where its self-check runs, the widest
build first."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quasar_deploy.cpu import choice, linears, native
from quasar_deploy.cpu import int8_linear as cpu_int8
from quasar_deploy.cpu import threads as openmp
from quasar_deploy.errors import QuasarError
from quasar_deploy.scheme import quantize_weight

runs_here = pytest.mark.skipif(cpu_int8.why_not() is not None, reason=f"our int8 kernel does not run here: {cpu_int8.why_not()}")


def _layer(out_features: int, in_features: int, rows: int, seed: int, bias: bool):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[:, : min(2, in_features)] *= 50  # outlier channels: codes at +-127 in every row
    wq, scale = quantize_weight(weight)
    return wq, scale, (torch.randn(out_features, generator=generator) if bias else None), x


def _both(wq, scale, bias, input_scale, x):
    expected = linears.int8_linear(wq, scale, bias, input_scale, "reference")(x)
    return expected, linears.int8_linear(wq, scale, bias, input_scale, "quasar")(x)


def _running_builds() -> list[str]:
    return [name for name in cpu_int8.BUILDS if cpu_int8.open_build(name)[0] is not None]


@pytest.fixture(params=list(cpu_int8.BUILDS))
def each_build(request, monkeypatch):
    """Each build of the kernel in turn, where it runs here (skipped, saying why, where it does not)."""
    lib, reason = cpu_int8.open_build(request.param)
    if lib is None:
        pytest.skip(f"{request.param} does not run here: {reason}")
    monkeypatch.setattr(cpu_int8, "library", lambda: (lib, None))
    return request.param


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None, reason="x86 with a C compiler")
def test_the_avx2_build_runs_on_every_x86_cpu_this_project_has():
    """Every CPU kind of this project has AVX2: there the AVX2 build must pass its self-check (so its branch of the
    kernel is tested on every kind, not only where it is the one that runs)."""
    lib, reason = cpu_int8.open_build("cpu_int8-avx2")
    assert lib is not None, reason


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 300),
    rows=st.integers(1, 20),
    static=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_is_the_reference_at_any_shape(each_build, out_features, in_features, rows, static, bias, seed):
    """Column counts off the 64-column blocks and 32-column spans, depths off the 4-value groups, row counts off each
    build's passes (6, 3 or 2 rows)."""
    wq, scale, b, x = _layer(out_features, in_features, rows, seed, bias)
    input_scale = (x.abs().max() / 127).reshape(1) if static else None
    expected, got = _both(wq, scale, b, input_scale, x)
    assert torch.equal(got, expected)


@runs_here
@pytest.mark.parametrize(
    "rows, in_features, out_features",
    [
        (2, 64, 130),
        (6, 1024, 130),
        (16, 128, 130),
        (17, 192, 130),
        (40, 256, 130),
        (48, 2048, 130),
        (33, 203, 130),
        (70, 1024, 600),
        (100, 4096, 200),
    ],
)
def test_every_build_that_runs_here_is_the_reference_at_tile_shapes(monkeypatch, rows, in_features, out_features):
    """Rows in and off whole tile groups and (past 48) pairs of them, depths in whole 64-byte tile rows (the tiles'
    case) and off them (the vectors' case), blocks in one panel and in several (4 blocks a panel at 1024 deep, 1 at
    4096): each build that runs here
    (both on a CPU whose AMX Linux grants, the vector one elsewhere) gives the same bits."""
    wq, scale, bias, x = _layer(out_features, in_features, rows, rows, True)
    expected = linears.int8_linear(wq, scale, bias, None, "reference")(x)
    for name in _running_builds():
        monkeypatch.setattr(cpu_int8, "library", lambda name=name: cpu_int8.open_build(name))
        assert torch.equal(linears.int8_linear(wq, scale, bias, None, "quasar")(x), expected), name
        assert torch.equal(linears.int8_linear(wq, scale, bias, None, "quasar")(x[:1]), expected[:1]), name


def test_extreme_codes_and_deep_rows_sum_bit_exact(each_build):
    """Full-range codes at K = 12288 (sums past 2^24, where float32 rounds them: as the reference's ``.float()`` does)."""
    k = 12288
    wq = torch.full((70, k), 127, dtype=torch.int8)
    wq[1::2] = -127
    wq[5, ::3] = 0
    x = torch.ones(19, k)  # past one tile group where the tiles run
    x[1::2, ::2] = -1
    expected, got = _both(wq, torch.full((70, 1), 1e-3), None, None, x)
    assert expected.abs().max() > 2**24 * 1e-3 / 127 and torch.equal(got, expected)


# off whole tile rows (the vectors); in them (the tiles, where they run), enough values to quantize side by side
@pytest.mark.parametrize("rows, in_features", [(40, 520), (260, 512)])
def test_a_rows_bits_do_not_depend_on_its_company_or_the_threads(each_build, monkeypatch, rows, in_features):
    """Shares of one block each, as many as 5 threads, in torch's OpenMP pool and on Python threads."""
    wq, scale, bias, x = _layer(1000, in_features, rows, 0, True)
    linear = linears.int8_linear(wq, scale, bias, None, "quasar")
    together = linear(x)
    monkeypatch.setattr(native, "MIN_SHARE_BYTES", 1)  # every block a share of its own where threads allow
    monkeypatch.setattr(cpu_int8, "ROWS_PER_SHARE", 1)
    threads, lib = torch.get_num_threads(), cpu_int8.library()[0]
    runtime = openmp.parallel_entry_points()
    try:
        for handed in (runtime, None):  # shares in torch's OpenMP pool, and on threads of our own where there is none
            lib.quasar_int8_use_openmp(*(handed or (None, None, None)))
            for count in (1, 2, 3, 5):
                torch.set_num_threads(count)
                split = linears.int8_linear(wq, scale, bias, None, "quasar")
                assert torch.equal(split(x), together)
                for i in (0, 6, 16, rows - 1):
                    assert torch.equal(split(x[i : i + 1])[0], together[i])
                assert torch.equal(split(x[:33]), together[:33])
    finally:
        torch.set_num_threads(threads)
        lib.quasar_int8_use_openmp(*(runtime or (None, None, None)))


@pytest.fixture
def fresh_probe(monkeypatch, tmp_path):
    """The kernel built into an empty cache and probed anew; the next caller probes this CPU itself again."""
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    monkeypatch.delenv(native.PREBUILT_ENV, raising=False)
    for cached in (cpu_int8.library, cpu_int8.open_build, choice.int8_probe):
        cached.cache_clear()
    yield
    for cached in (cpu_int8.library, cpu_int8.open_build, choice.int8_probe):
        cached.cache_clear()


def test_a_build_that_fails_its_self_check_is_not_offered(fresh_probe, monkeypatch):
    real_run = subprocess.run

    def run(command, **kwargs):
        if "quasar_probe" in command[-1] and "cpu_int8" in command[-1]:  # the child that runs the build's self-check
            return subprocess.CompletedProcess(command, -4)  # as a SIGILL would end it
        return real_run(command, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", run)
    assert "failed its self-check (exit -4)" in cpu_int8.why_not()
    assert not linears.quasar_int8_available() and "quasar" not in choice.int8_probe().ms
    with pytest.raises(QuasarError, match="the quasar kernel does not run here: .*self-check"):
        linears.check_int8_kernel("quasar")


def test_where_the_tiles_fail_their_self_check_the_vector_build_runs(fresh_probe, monkeypatch):
    """On a CPU without AMX (or a Linux that does not grant its state) the tiles' child dies or reports; the vectors'
    build is offered instead, and doctor names it."""
    real_run = subprocess.run

    def run(command, **kwargs):
        if "quasar_probe" in command[-1] and cpu_int8.AMX_BUILD in command[-1]:
            return subprocess.CompletedProcess(command, -4)
        return real_run(command, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", run)
    if cpu_int8.open_build("cpu_int8-avx512vnni")[0] is None:
        pytest.skip(f"no build of our kernel runs here: {cpu_int8.why_not()}")
    assert cpu_int8.build() == "cpu_int8-avx512vnni" and cpu_int8.why_not() is None
    assert "failed its self-check (exit -4)" in cpu_int8.open_build(cpu_int8.AMX_BUILD)[1]


def test_where_linux_refuses_the_tile_state_the_vector_build_runs(fresh_probe, monkeypatch):
    real_cdll = cpu_int8.ctypes.CDLL

    class Refusing:
        def __init__(self, path):
            self._lib = real_cdll(path)

        def quasar_int8_enable_amx(self):
            return 1

        def __getattr__(self, name):
            return getattr(self._lib, name)

    monkeypatch.setattr(cpu_int8.ctypes, "CDLL", Refusing)
    lib, reason = cpu_int8.open_build(cpu_int8.AMX_BUILD)
    assert lib is None and (reason == "Linux refused this process the AMX tile state" or reason.startswith("failed its self-check"))
    assert cpu_int8.build() != cpu_int8.AMX_BUILD  # a CPU without AMX fails in the child, before the process asks


def test_without_a_compiler_the_kernel_is_not_offered(fresh_probe, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    assert "no C compiler (no-such-compiler)" in cpu_int8.why_not()
    assert choice.default_int8_kernel("cpu") != "quasar"


@pytest.mark.parametrize("interface", [None, 1])
def test_a_prebuilt_kernel_from_another_source_is_refused_in_one_line(fresh_probe, monkeypatch, tmp_path, interface):
    """A library in ``$QUASAR_KERNELS`` that passes its self-check but takes other arguments than this version passes
    (built from an older source: no interface number, or another one) is not offered, instead of being called wrongly."""
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stale library")
    prebuilt = tmp_path / "kernels"
    prebuilt.mkdir()
    source = "int quasar_probe(void) { return 0; }\n"
    if interface is not None:
        source += f"int quasar_int8_interface(void) {{ return {interface}; }}\n"
    (tmp_path / "old.c").write_text(source)
    for name in cpu_int8.BUILDS:
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(prebuilt / f"{name}.so"), str(tmp_path / "old.c")], check=True)
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt))
    reason = cpu_int8.why_not()
    assert f"was built from another version's source (interface {interface}, this version calls {cpu_int8.INTERFACE})" in reason
    assert "\n" not in reason and not linears.quasar_int8_available()


def test_a_pinned_build_is_the_only_one_tried(fresh_probe, monkeypatch):
    """``QUASAR_INT8_BUILD`` names the build to run (to time a narrower one on a wider CPU); a name of none is refused in
    one line, and the kernel is then not offered."""
    monkeypatch.setenv(cpu_int8.BUILD_ENV, "cpu_int8-avx2")
    if cpu_int8.open_build("cpu_int8-avx2")[0] is None:
        pytest.skip(f"the AVX2 build does not run here: {cpu_int8.open_build('cpu_int8-avx2')[1]}")
    assert cpu_int8.build() == "cpu_int8-avx2" and cpu_int8.why_not() is None
    cpu_int8.library.cache_clear()
    monkeypatch.setenv(cpu_int8.BUILD_ENV, "cpu_int8-sse")
    reason = cpu_int8.why_not()
    assert reason.startswith("QUASAR_INT8_BUILD=cpu_int8-sse names no build of it: choose from cpu_int8-amx, ") and "\n" not in reason
    assert cpu_int8.build() is None and not linears.quasar_int8_available()


@pytest.mark.parametrize("fbgemm_32bit", [True, False])
def test_fbgemms_split_kernel_is_timed_only_where_its_own_kernel_saturates(monkeypatch, fbgemm_32bit):
    """On an AVX2 CPU FBGEMM's split kernel (exact at twice the rows) is timed against our AVX2 build; where FBGEMM sums
    in 32 bits its one-call kernel is timed instead."""
    monkeypatch.setattr(linears, "fbgemm_available", lambda: True)
    monkeypatch.setattr(linears, "vnni_available", lambda: fbgemm_32bit)
    monkeypatch.setattr(linears, "onednn_int8_bit_exact", lambda: False)
    monkeypatch.setattr(linears, "quasar_int8_available", lambda: True)
    monkeypatch.setattr(choice, "onnxruntime_int8_bit_exact", lambda: False)
    assert choice.int8_kernels_to_time() == (["fbgemm-vnni", "quasar"] if fbgemm_32bit else ["quasar", "fbgemm"])


def test_with_no_bit_exact_kernel_but_the_reference_the_reference_runs(monkeypatch):
    monkeypatch.setattr(choice, "int8_kernels_to_time", lambda: [])
    choice.int8_probe.cache_clear()
    try:
        assert choice.default_int8_kernel("cpu") == "reference"
        assert choice.int8_probe().reason.startswith("no bit-exact int8 kernel but the reference here")
    finally:
        choice.int8_probe.cache_clear()


def test_onnx_runtimes_int8_linear_in_the_probe_is_the_reference():
    """What the probe times for ONNX Runtime is the integer graph's linear, bit for bit the scheme's."""
    pytest.importorskip("onnxruntime")
    wq, scale, _, x = _layer(300, 200, 7, 3, False)
    expected = linears.int8_linear(wq, scale, None, None, "reference")(x)
    assert torch.equal(choice._onnxruntime_int8(wq, scale)(x), expected)


@pytest.mark.parametrize("ort_ms, backend", [(None, "cpu"), (9.0, "cpu"), (2.5, "cpu"), (2.4, "onnxruntime"), (1.0, "onnxruntime")])
def test_w8a8_artifacts_run_where_the_int8_linear_timed_faster(monkeypatch, ort_ms, backend):
    """ONNX Runtime's int8 linear is timed beside ours (where it is installed and exact): where ours is not faster by
    the margin (1.25x), ``auto`` runs artifacts on it, and the torch backend's kernel is still the fastest of its own;
    doctor says so."""
    from quasar_deploy.backends import registry

    timed = {"quasar": 2.0, "fbgemm": 3.0, **({choice.ONNXRUNTIME: ort_ms} if ort_ms else {})}
    monkeypatch.setattr(choice, "int8_probe", lambda: choice.Int8Probe(timed))
    probe = choice.int8_probe()
    assert probe.kernel == "quasar" and choice.default_int8_kernel("cpu") == "quasar"
    assert registry.cpu_runs_better(artifact=True) == (backend == "cpu")
    assert ("W8A8 artifacts run there" in probe.reason) == (backend == "onnxruntime")


def test_onnx_runtime_is_timed_beside_the_kernels_where_it_is_bit_exact(monkeypatch):
    monkeypatch.setattr(linears, "fbgemm_available", lambda: True)
    monkeypatch.setattr(linears, "vnni_available", lambda: False)
    monkeypatch.setattr(linears, "onednn_int8_bit_exact", lambda: False)
    monkeypatch.setattr(linears, "quasar_int8_available", lambda: True)
    monkeypatch.setattr(choice, "onnxruntime_int8_bit_exact", lambda: True)
    assert choice.int8_kernels_to_time() == ["quasar", "fbgemm", choice.ONNXRUNTIME]
    monkeypatch.setattr(linears, "fbgemm_available", lambda: False)
    monkeypatch.setattr(linears, "quasar_int8_available", lambda: False)
    assert choice.int8_kernels_to_time() == []  # nothing of the torch backend's to weigh it against
