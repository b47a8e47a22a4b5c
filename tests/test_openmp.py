"""The scheduler's thread runs the model at full speed only once the loading thread has given back its OpenMP pool."""

import threading

import torch

from quasar_deploy.api import load
from quasar_deploy.cpu import threads
from quasar_deploy.serve import scheduler as scheduler_module


def test_release_openmp_pool_frees_the_callers_pool_and_torch_still_computes():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    before = x @ w.T  # runs a parallel region in this thread: its pool exists
    assert threads.release_openmp_pool()  # torch's CPU wheels ship an OpenMP 5 runtime (omp_pause_resource_all)
    assert torch.equal(x @ w.T, before)  # the pool is rebuilt on demand, the result unchanged


def test_release_from_another_thread_leaves_this_threads_work_correct():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    expected = x @ w.T
    results = []
    thread = threading.Thread(target=lambda: results.append((threads.release_openmp_pool(), x @ w.T)))
    thread.start()
    thread.join()
    assert results[0][0] and torch.equal(results[0][1], expected)


def test_scheduler_releases_the_loading_threads_pool(monkeypatch, tiny_artifact):
    engine = load(tiny_artifact.path, backend="cpu")
    calls = []
    monkeypatch.setattr(scheduler_module, "release_openmp_pool", lambda: calls.append(threading.current_thread()) or True)
    scheduler_module.Scheduler(engine, scheduler_module.Metrics())
    assert calls == [threading.current_thread()]  # the thread that built it: the one that loaded the model
