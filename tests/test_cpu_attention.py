"""The C attention kernel of the layer graphs (``cpu/decoder_ops``): its values, the independence of a row's bits
from its company, and the choice of build by probe."""

from __future__ import annotations

import mmap
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quasar_deploy.cpu import decoder_ops, native
from quasar_deploy.cpu.decoder_ops import BUILDS, StepAttention, new_caches

HEADS, KV, LAYERS = 4, 2, 2
PASTS, SIZES = [0, 37, 150], [5, 1, 8]  # a prompt, a one-token decode, a verify block


def runnable_widths() -> list[int]:
    return [width for width in BUILDS if decoder_ops.probe(width)[0] is not None]


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel(request) -> decoder_ops.Kernel:
    built, reason = decoder_ops.probe(request.param)
    if built is None:
        if request.param == 8 and decoder_ops.load() is not None:
            pytest.fail(f"a wider build runs here but the 8-wide one does not: {reason}")
        pytest.skip(f"the {request.param}-wide build does not run on this CPU: {reason}")
    return built


def filled_cache(k: np.ndarray, v: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's cache in the kernel's layout holding past keys and values ``k``, ``v`` [kv_heads, past, dim]."""
    kv, past, dim = k.shape
    [(keys, values)] = new_caches(1, kv, capacity, dim)
    for t in range(past):
        keys[:, t // 16, :, t % 16] = k[:, t]
    values[:, :past] = v
    return keys, values


def case(dim: int, seed: int = 0):
    """Caches holding random past keys and values, and the new rows of each sequence, at every layer."""
    rng = np.random.default_rng(seed)
    caches, history = [], []
    for past in PASTS:
        kept = [tuple(rng.standard_normal((2, KV, past, dim)).astype(np.float32)) for _ in range(LAYERS)]
        caches.append([filled_cache(k, v, 256) for k, v in kept])
        history.append(kept)
    rows = sum(SIZES)
    new = [rng.standard_normal((rows, width)).astype(np.float32) for width in (HEADS * dim, KV * dim, KV * dim)]
    return caches, history, new


def reference(past_kv, new, pasts, sizes, heads: int, kv: int) -> np.ndarray:
    """Causal attention in float64, sequence by sequence: ``past_kv[s]`` is sequence s's past (keys, values)."""
    q, k, v = (a.astype(np.float64) for a in new)
    dim = q.shape[1] // heads
    out, start = np.zeros_like(q), 0
    for past, n, (old_k, old_v) in zip(pasts, sizes, past_kv):
        rows = slice(start, start + n)
        keys = np.concatenate([old_k, k[rows].reshape(n, kv, dim).transpose(1, 0, 2)], axis=1)
        values = np.concatenate([old_v, v[rows].reshape(n, kv, dim).transpose(1, 0, 2)], axis=1)
        for head in range(heads):
            group = head // (heads // kv)
            for r in range(n):
                scores = keys[group, : past + r + 1] @ q[start + r, head * dim : (head + 1) * dim] / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[start + r, head * dim : (head + 1) * dim] = weights @ values[group, : past + r + 1] / weights.sum()
        start += n
    return out


def attend(kernel, caches, pasts, sizes, new, layer=0, threads=1, openmp=False):
    pool = decoder_ops.ThreadPoolExecutor(threads - 1) if threads > 1 else None
    dim = new[0].shape[1] // HEADS
    return StepAttention(kernel, pool, threads, HEADS, KV, dim, caches, pasts, sizes, openmp)(layer, *new)


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_it_computes_causal_attention_over_each_sequences_cache(kernel, dim):
    if dim % kernel.width:
        pytest.skip("not a whole number of vectors")
    caches, history, new = case(dim)
    for layer in range(LAYERS):
        got = attend(kernel, caches, PASTS, SIZES, new, layer, threads=2)
        expected = reference([kept[layer] for kept in history], new, PASTS, SIZES, HEADS, KV)
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("openmp", [False, True], ids=["own-threads", "openmp-pool"])
def test_a_rows_bits_do_not_depend_on_its_company_its_block_or_the_threads(kernel, monkeypatch, openmp):
    """Each sequence alone, its rows one at a time (decode steps), and all of them together on two threads whatever the
    split, on threads of our own (the layer graphs) or in torch's OpenMP pool (the torch decoder): the same bits for
    every row, which is what keeps a served request's output its output alone."""
    if openmp and not kernel.openmp:
        pytest.skip("this process has no OpenMP runtime to share a step in")
    dim = 64
    monkeypatch.setattr(decoder_ops, "MIN_SHARE", 1)  # split the small case over the threads too
    monkeypatch.setattr(decoder_ops, "OPENMP_MIN_SHARE", 1)
    caches, _, new = case(dim)
    together = attend(kernel, caches, PASTS, SIZES, new, threads=2, openmp=openmp)
    start = 0
    for s, (past, n) in enumerate(zip(PASTS, SIZES)):
        rows = slice(start, start + n)
        fresh, _, _ = case(dim)
        alone = attend(kernel, [fresh[s]], [past], [n], [a[rows] for a in new])
        assert np.array_equal(alone, together[rows])
        fresh, _, _ = case(dim)
        for r in range(n):  # one row a step, its keys written as it goes
            row = slice(start + r, start + r + 1)
            decoded = attend(kernel, [fresh[s]], [past + r], [1], [a[row] for a in new], threads=2, openmp=openmp)
            assert np.array_equal(decoded[0], together[start + r])
        start += n


def test_the_widest_build_that_passes_its_probe_is_chosen(monkeypatch, tmp_path):
    runs_here = runnable_widths()  # this CPU's own answer, before the self-checks are made to fail
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    real_run = subprocess.run
    failing: set[int] = set()

    def run(command, **kwargs):
        if command[0] != "cc" and "quasar_probe" in command[-1]:  # the child that runs a build's self-check
            width = int(command[-1].split("cpu_attention-")[1].split("-")[0])
            if width in failing:
                return subprocess.CompletedProcess(command, -4)  # as a SIGILL would end it
        return real_run(command, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", run)
    outcomes = {}
    try:
        for failing_now in (set(), {16}, {16, 8}):
            failing.clear()
            failing.update(failing_now)
            decoder_ops.probe.cache_clear()
            kernel = decoder_ops.load()
            outcomes[frozenset(failing_now)] = (kernel.width if kernel else None, decoder_ops.why_not())
    finally:
        decoder_ops.probe.cache_clear()  # the next caller probes this CPU itself
    if runs_here:
        assert outcomes[frozenset()] == (runs_here[0], None)
    if 8 in runs_here:
        assert outcomes[frozenset({16})] == (8, None)
    width, why = outcomes[frozenset({16, 8})]
    assert width is None and "16-wide build: failed its self-check (exit -4)" in why and "8-wide" in why


def test_a_head_the_widest_build_cannot_take_goes_to_a_narrower_one():
    """A head of 24 floats is three 8-float vectors but not whole 16-float ones: the 8-wide build takes it where it runs,
    and where no build takes it ``why_not`` says so for each."""
    runs_here = runnable_widths()
    if 8 not in runs_here:
        pytest.skip("the 8-wide build does not run on this CPU")
    assert decoder_ops.load(24).width == 8
    assert decoder_ops.load(64).width == runs_here[0]
    assert decoder_ops.load(12) is None
    assert "8-wide build: a head of 12 floats is not whole 8-float vectors" in decoder_ops.why_not(12)


def test_without_a_compiler_the_layer_graphs_keep_group_query_attention(monkeypatch, tmp_path):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    decoder_ops.probe.cache_clear()
    try:
        assert decoder_ops.load() is None
        assert "no C compiler (no-such-compiler) on PATH" in decoder_ops.why_not()
    finally:
        decoder_ops.probe.cache_clear()


def test_a_prebuilt_kernel_needs_no_compiler(monkeypatch, tmp_path):
    """``$QUASAR_KERNELS`` (the cpu image's): libraries found there are probed and used, with no compiler around."""
    runs_here = runnable_widths()
    if not runs_here:
        pytest.skip("no build runs on this CPU")
    prebuilt = tmp_path / "kernels"
    prebuilt.mkdir()
    for width in runs_here:
        (prebuilt / f"cpu_attention-{width}.so").write_bytes(decoder_ops.probe(width)[0].path.read_bytes())
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt))
    decoder_ops.probe.cache_clear()
    try:
        kernel = decoder_ops.load()
        assert kernel is not None and kernel.width == runs_here[0] and kernel.path.parent == prebuilt
    finally:
        decoder_ops.probe.cache_clear()


def test_a_prebuilt_kernel_from_an_older_source_is_refused_in_one_line(monkeypatch, tmp_path):
    """A library in ``$QUASAR_KERNELS`` that passes its self-check but lacks an entry point this version calls (built
    from an older source) is not used, and ``why_not`` says so, instead of a crash at the first call."""
    import shutil
    import subprocess

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stale library")
    prebuilt = tmp_path / "kernels"
    prebuilt.mkdir()
    (tmp_path / "old.c").write_text("int quasar_probe(void) { return 0; }\n")
    for width in BUILDS:
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(prebuilt / f"cpu_attention-{width}.so"), str(tmp_path / "old.c")], check=True)
    monkeypatch.setenv(native.PREBUILT_ENV, str(prebuilt))
    decoder_ops.probe.cache_clear()
    try:
        assert decoder_ops.load() is None
        reason = decoder_ops.why_not()
        assert "lacks an entry point this version calls" in reason and "undefined symbol" in reason and "\n" not in reason
    finally:
        decoder_ops.probe.cache_clear()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(4, 2), (8, 2), (4, 4), (6, 1), (16, 2)]),
    vectors=st.integers(1, 9),
    blocks=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), min_size=1, max_size=4),
    threads=st.integers(1, 2),
    openmp=st.booleans(),
)
def test_any_shape_matches_the_reference_and_any_company(kernel, monkeypatch, shape, vectors, blocks, threads, openmp):
    """Group sizes, head dimensions of any whole number of vectors, any lengths and block sizes: the values of causal
    attention, and a sequence's bits the same alone as among the others."""
    heads, kv = shape
    dim = vectors * kernel.width
    monkeypatch.setattr(decoder_ops, "MIN_SHARE", 1)
    monkeypatch.setattr(decoder_ops, "OPENMP_MIN_SHARE", 1)
    rng = np.random.default_rng(len(blocks) * 1000 + dim)
    pasts, sizes = [p for p, _ in blocks], [n for _, n in blocks]

    past_kv = [tuple(np.random.default_rng(past).standard_normal((2, kv, past, dim)).astype(np.float32)) for past in pasts]

    def cache(s: int) -> list[tuple[np.ndarray, np.ndarray]]:  # sequence s's one layer, fresh
        return [filled_cache(*past_kv[s], -(-(pasts[s] + sizes[s]) // 256) * 256)]

    rows = sum(sizes)
    q, k, v = (rng.standard_normal((rows, width)).astype(np.float32) for width in (heads * dim, kv * dim, kv * dim))
    pool = decoder_ops.ThreadPoolExecutor(1)
    caches = [cache(s) for s in range(len(blocks))]
    together = StepAttention(kernel, pool, threads, heads, kv, dim, caches, pasts, sizes, openmp)(0, q, k, v)
    np.testing.assert_allclose(together, reference(past_kv, (q, k, v), pasts, sizes, heads, kv), rtol=0, atol=5e-6)
    start = 0
    for s, (past, n) in enumerate(blocks):
        rows_of = slice(start, start + n)
        alone = StepAttention(kernel, pool, 1, heads, kv, dim, [cache(s)], [past], [n])(0, q[rows_of], k[rows_of], v[rows_of])
        assert np.array_equal(alone, together[rows_of])
        start += n
    pool.shutdown()


def test_a_sequences_caches_are_zeroed_layers_of_their_own_in_one_mapping():
    """Every layer's keys and values in the kernel's layout, zeroed, writable, none overlapping another, all in one
    mapping that lives as long as any of them."""
    import gc
    import weakref

    caches = new_caches(3, 2, 32, 16)
    assert [(k.shape, v.shape) for k, v in caches] == [((2, 2, 16, 16), (2, 32, 16))] * 3
    arrays = [a for pair in caches for a in pair]
    assert all(a.dtype == np.float32 and a.flags.writeable and not a.any() for a in arrays)
    for i, array in enumerate(arrays):
        array.fill(i + 1)
    assert [float(a.min()) for a in arrays] == [float(a.max()) for a in arrays] == [float(i + 1) for i in range(6)]
    mapping = arrays[0].base
    while not isinstance(mapping, mmap.mmap):
        mapping = mapping.base if isinstance(mapping, np.ndarray) else mapping.obj
    assert all(np.shares_memory(a, np.frombuffer(mapping, np.float32)) for a in arrays)
    gone = weakref.finalize(mapping, lambda: None)
    del mapping, caches, arrays, array
    gc.collect()
    assert not gone.alive
