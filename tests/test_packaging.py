"""The README's commands are the ones CI runs, and the shipped data is inside the package."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the README's test command, its steps in order; CI runs each of them as written
TEST_COMMAND = (
    "pip install torch==2.13.0 && pip install -e '.[test]'",
    "python tools/onnxruntimes.py install .onnxruntimes",
    "python -m pytest",
)


def _in_order(text: str, steps: tuple[str, ...]) -> bool:
    position = 0
    for step in steps:
        position = text.find(step, position)
        if position < 0:
            return False
        position += len(step)
    return True


def test_ci_runs_the_readme_test_command():
    assert _in_order((ROOT / "README.md").read_text(), TEST_COMMAND)
    assert _in_order((ROOT / ".ci" / "run").read_text(), TEST_COMMAND)


def test_builtin_text_sets_ship_with_the_package():
    from quasar_deploy.calibration.data import BUILTIN, read_texts

    calibration, held_out = read_texts(BUILTIN["calibration"]), read_texts(BUILTIN["eval"])
    assert len(calibration) >= 16 and len(held_out) >= 8
    assert not set(calibration) & set(held_out)


def test_help_imports_no_torch():
    """`quasar-deploy --help` (and each command's) must be instant: torch, transformers and numpy load only inside commands."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from quasar_deploy.cli import main\n"
        "commands = [], ['generate'], ['bench', 'e2e'], ['bench', 'write-checkpoint'], ['export'], ['calibrate'], ['serve']\n"
        "for args in (command + ['--help'] for command in commands):\n"
        "    result = CliRunner().invoke(main, args)\n"
        "    assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'fastapi') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_export_function_survives_importing_the_exporters():
    import quasar_deploy
    import quasar_deploy.exporters.onnx  # noqa: F401

    assert callable(quasar_deploy.export) and quasar_deploy.export.__module__ == "quasar_deploy.exporters"


def test_the_product_imports_no_benchmark():
    """inflate and the demo are product code: neither may pull in the benchmarks (or the bench extra's matplotlib)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import quasar_deploy.inflate, quasar_deploy.demo, quasar_deploy.demo.run\n"
        "print(sorted(m for m in sys.modules if m.startswith('quasar_deploy.bench') or m.startswith('matplotlib')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    assert (
        "quasar_deploy.inflate"
        in subprocess.run(
            [sys.executable, "-c", script.replace("bench')", "inflate')")], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
    )  # the same check sees a module that is imported


def test_matplotlib_is_the_bench_extra_only():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("matplotlib")]
    assert "matplotlib" in project["optional-dependencies"]["bench"]


def test_bench_e2e_without_matplotlib_names_the_extra_before_running(monkeypatch):
    import sys

    from click.testing import CliRunner

    from quasar_deploy.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    result = CliRunner().invoke(main, ["bench", "e2e", "--synthetic", "qwen3-0.6b"])
    assert result.exit_code == 1
    assert result.output == "error: the report's plots need matplotlib: pip install 'quasar-deploy[bench]'\n"


def test_the_readme_is_a_front_door():
    """Short, lines of normal length, and no measurement history: figures live in docs/benchmarks.md (generated)."""
    import re

    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200 and max(map(len, lines)) <= 200
    assert not re.search(r"20\d\d-\d\d-\d\d|load (average )?\d|/work/|/home/|/root/", text)
    assert "docs/benchmarks.md" in text
