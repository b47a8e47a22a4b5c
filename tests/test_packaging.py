"""The README's commands are the ones CI runs, and the shipped data is inside the package."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_COMMAND = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest"


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in (ROOT / "README.md").read_text()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


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
