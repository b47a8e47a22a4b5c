#!/usr/bin/env bash
# The prepared device check for the cuda backend: GPU tests, then one table (docs/cuda.md).
#
# Runs the project from this checkout (PYTHONPATH), downloads nothing, fits in 8 minutes on one
# H200: the @pytest.mark.gpu tests (<= 3 min), then `python -m quasar_deploy.bench.gpu` (<= 4.5 min).
# Missing pure-Python dependencies are installed offline from tools/wheels/ (or $QUASAR_WHEELS)
# into a temporary directory when wheels are there; otherwise the script says what it lacks and
# skips only what needs it. Output: stdout, and gpu-check.json in $OUT (or the current directory): a bench record, for bench/results/.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-.}
WHEELS=${QUASAR_WHEELS:-tools/wheels}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

missing() {  # the modules of "$@" that do not import
    "$PYTHON" - "$@" <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
}

echo "== environment"
"$PYTHON" - <<'PY' || { echo "gpu_check: torch does not import"; exit 1; }
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU visible: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"{torch.cuda.get_device_name(0)}, compute capability {'.'.join(map(str, torch.cuda.get_device_capability(0)))}")
PY

lacking=$(missing numpy safetensors tokenizers transformers tqdm triton click pytest)
if [ -n "$lacking" ] && [ -d "$WHEELS" ]; then
    target=$(mktemp -d)
    echo "installing from $WHEELS (offline) into $target: $lacking"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$target" $lacking \
        || echo "gpu_check: offline install from $WHEELS failed for some of: $lacking"
    export PYTHONPATH="$PYTHONPATH:$target"
    lacking=$(missing numpy safetensors tokenizers transformers tqdm triton click pytest)
fi
[ -n "$lacking" ] && echo "gpu_check: missing Python modules: $lacking"
for needed in numpy safetensors tokenizers transformers tqdm; do
    case " $lacking " in *" $needed "*)
        echo "gpu_check: cannot run without $needed (put its wheel in $WHEELS; docs/cuda.md)"; exit 1;;
    esac
done
case " $lacking " in *" triton "*) echo "gpu_check: no Triton: the fused quantizer cannot run; using --quantizer torch";; esac

"$PYTHON" -c "from quasar_deploy.backends.cuda import unavailable as u; r = u(); print('cuda backend:', r or 'ready'); raise SystemExit(r is not None)" \
    || { echo "gpu_check: the cuda backend cannot run here"; exit 1; }

status=0
echo "== GPU tests (pytest -m gpu)"
case " $lacking " in
    *" pytest "*) echo "gpu_check: pytest missing: GPU tests NOT run";;
    *) timeout 180 "$PYTHON" -m pytest -m gpu tests/test_cuda.py -q -rs -s -p no:cacheprovider || status=$?;;
esac

echo "== bench gpu"
quantizer=triton
case " $lacking " in *" triton "*) quantizer=torch;; esac
timeout 270 "$PYTHON" -m quasar_deploy.bench.gpu --quantizer "$quantizer" --json-out "$OUT_DIR/gpu-check.json" || status=$?
exit $status
