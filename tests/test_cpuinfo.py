"""Thread counts follow what the process may really use: affinity and the container's CPU quota."""

from quasar_deploy.cpuinfo import cgroup_cpu_limit, default_threads


def test_cgroup_v2_and_v1_quotas(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 3.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
    assert cgroup_cpu_limit(tmp_path / "none") is None


def test_default_threads_never_exceeds_the_affinity_or_the_quota(monkeypatch):
    import os

    import quasar_deploy.cpuinfo as cpuinfo

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(cpuinfo, "cgroup_cpu_limit", lambda: 2.5)
    assert default_threads() == 3
    monkeypatch.setattr(cpuinfo, "cgroup_cpu_limit", lambda: None)
    assert default_threads() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert default_threads() == 1
