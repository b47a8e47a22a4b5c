"""Calibration must fit in about twice the model's float32 size: measured as peak RSS in a fresh process."""

import subprocess
import sys
from pathlib import Path

import pytest

from .tiny import save_tiny

SCRIPT = r"""
import sys
from pathlib import Path
from quasar_deploy import calibrate

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

small, big, work = map(Path, sys.argv[1:4])
calibrate(small, work / "small-w8a8", num_samples=2, seq_len=16, progress=False)  # load every library first
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
calibrate(big, work / "big-w8a8", num_samples=4, seq_len=64, progress=False)
print(before, status("VmHWM"))
"""


@pytest.mark.slow
def test_peak_memory_within_twice_float_size(tiny_qwen3, tmp_path):
    big = save_tiny(
        tmp_path / "big", "qwen3", hidden_size=512, intermediate_size=2048, num_hidden_layers=8, vocab_size=32000, num_attention_heads=8
    )
    float_bytes = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_qwen3), str(big), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    before, peak = map(int, out.stdout.split()[-2:])
    assert float_bytes < peak - before <= 2.0 * float_bytes, (float_bytes, before, peak)
