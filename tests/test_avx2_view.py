"""tools/avx2_view.sh, which CI runs the suite under: it must still cap what it says it caps with the torch installed.
Were a torch to ignore oneDNN's cap, the second pass would silently test this CPU's branches again."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "avx2_view.sh"

REPORT = """
import json, torch
from quasar_deploy.cpu import choice, decoder_ops, int8_linear, linears
attention = decoder_ops.load()
print(json.dumps({
    "bf16_missing": linears.float_probe().bf16_missing,
    "float_dtype": str(linears.default_float_dtype("cpu")),
    "fbgemm_sums_32bit": linears.vnni_available(),
    "int8_kernel": choice.default_int8_kernel("cpu"),
    "attention_width": attention.width if attention else None,
    "int8_build": int8_linear.build(),
    "int8_why_not": int8_linear.open_build("cpu_int8-avxvnni")[1],
    "timed": sorted(choice.int8_probe().ms),
}))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the view caps x86 instruction sets")
def test_the_view_runs_the_code_as_an_avx2_cpu_would(monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: the kernels' builds are not tried at all")
    monkeypatch.delenv("QUASAR_FLOAT_DTYPE", raising=False)  # the suite pins float32; the probe's choice is asked here
    result = subprocess.run(["bash", str(TOOL), sys.executable, "-c", REPORT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["bf16_missing"] and "bf16" in seen["bf16_missing"] and seen["float_dtype"] == "torch.float32"
    assert not seen["fbgemm_sums_32bit"]  # FBGEMM's AVX2 kernel sums product pairs in saturating 16 bits
    # our AVX2 build runs, timed against FBGEMM's split kernel (and oneDNN's, where it sums exactly: on an AVX2 CPU
    # it does, under the cap it does not, so neither is asserted)
    assert seen["int8_build"] == "cpu_int8-avx2" and {"quasar", "fbgemm"} <= set(seen["timed"])
    assert seen["int8_kernel"] in seen["timed"]
    assert seen["attention_width"] == 8  # the AVX-512 build faults in its self-check, the AVX2 one runs
    assert seen["int8_why_not"] == "failed its self-check (exit -4)"  # the AVX-VNNI build too


def test_the_view_refuses_to_run_nothing():
    result = subprocess.run(["bash", str(TOOL)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == "usage: tools/avx2_view.sh COMMAND [ARGS...]"
