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
