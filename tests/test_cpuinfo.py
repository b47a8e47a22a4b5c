"""Threads suit what the process may really use (affinity, the container's CPU quota) and a shared machine (OpenMP waits)."""

import json
import os
import subprocess
import sys

import pytest

from quasar_deploy.cpu.machine import cgroup_cpu_limit, default_threads, prefer_passive_waits


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

    from quasar_deploy.cpu import machine

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: 2.5)
    assert default_threads() == 3
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: None)
    assert default_threads() == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert default_threads() == 1


def test_passive_waits_only_on_an_oversubscribed_machine_and_unless_the_user_chose_a_policy():
    environ = {}
    prefer_passive_waits(environ, load=1.5, cpus=2)
    assert environ == {}  # spinning is faster where cores are free
    prefer_passive_waits(environ, load=7.0, cpus=2)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"OMP_WAIT_POLICY": "active"}
    prefer_passive_waits(environ, load=7.0, cpus=2)
    assert environ == {"OMP_WAIT_POLICY": "active"}


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("active", "active")])
def test_the_cli_sets_the_wait_policy_before_torch_loads(given, seen):
    """With the machine made to look oversubscribed (a fake load average), the CLI picks passive waits before torch loads."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    code = (
        "import os, sys; os.getloadavg = lambda: (1e6, 0, 0); "
        "from quasar_deploy.cli import main; sys.argv[1:] = ['doctor', '--json']; main()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["omp_wait_policy"] == seen
