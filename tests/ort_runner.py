"""Runs ONNX models on whichever onnxruntime this Python imports, for tests/test_onnx_runtimes.py, which starts it with
another release first on ``PYTHONPATH`` (tools/onnxruntimes.py installs them):

    python tests/ort_runner.py JOBS.json

JOBS.json: ``{"config": [[key, value], ...], "jobs": [{"name": ..., "model": ..., "feed": ..., "out": ...}, ...]}``;
each job loads ``model`` in a single-threaded CPU session with those config entries, runs it on the arrays of the
``feed`` .npz and writes every output to the ``out`` .npz. Prints one JSON line: the release imported, the highest
opset it knows per domain, and per job that failed, its one-line error. Imports numpy and onnxruntime alone.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnxruntime as ort


def known_opsets() -> dict[str, int]:
    """The newest version of any operator schema this release has, per domain (``ai.onnx`` for the default one): the
    highest opset it can load."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    newest: dict[str, int] = {}
    for schema in state.get_all_operator_schema():
        domain = schema.domain or "ai.onnx"
        newest[domain] = max(newest.get(domain, 0), schema.since_version)
    return newest


def run(job: dict, config: list[list[str]]) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for key, value in config:
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(job["model"], options, providers=["CPUExecutionProvider"])
    with np.load(job["feed"]) as feed:
        outputs = session.run(None, dict(feed))
    np.savez(job["out"], **{output.name: array for output, array in zip(session.get_outputs(), outputs)})


def main(path: str) -> int:
    with open(path) as file:
        plan = json.load(file)
    errors = {}
    for job in plan["jobs"]:
        try:
            run(job, plan["config"])
        except Exception as exc:  # reported per job: one refused model must not hide the others' results
            errors[job["name"]] = " ".join(str(exc).split())
    print(json.dumps({"release": ort.__version__, "opsets": known_opsets(), "errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
