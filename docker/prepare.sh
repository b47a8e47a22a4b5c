#!/bin/sh
# quasar-prepare PROFILE: make what one compose profile serves from the checkpoint at /checkpoint, into /models.
#
#   cpu, cuda         calibrate (W8A8, dynamic activations)             -> /models/<key>/w8a8
#   onnxruntime-gpu   calibrate --activation static, export onnx (QDQ)  -> /models/<key>/onnx
#   npu               calibrate, export npu (msModelSlim layout)        -> /models/<key>/npu
#
# <key> digests the checkpoint's bytes (every file's sha256) and this quasar-deploy's version: a changed checkpoint,
# or an upgrade, gets a new directory and the work is redone; an unchanged one reuses what is there, step by step
# (quasar-deploy writes each output atomically, so one that exists is complete). /models/PROFILE is then pointed at the
# result, which is the path that profile's server serves. Runs in the quasar-deploy:cpu image (docker/compose.yaml);
# QUASAR_CHECKPOINT and QUASAR_MODELS move the two directories.
set -eu

profile=${1:-}
source=${QUASAR_CHECKPOINT:-/checkpoint}
models=${QUASAR_MODELS:-/models}

case $profile in
    cpu | cuda) target=w8a8 ;;
    onnxruntime-gpu) target=onnx ;;
    npu) target=npu ;;
    *)
        echo "error: usage: quasar-prepare cpu|cuda|onnxruntime-gpu|npu (not '$profile')" >&2
        exit 2
        ;;
esac
if [ ! -f "$source/config.json" ]; then
    echo "error: $source has no config.json: set CHECKPOINT to a Hugging Face checkpoint directory" >&2
    exit 1
fi

echo "hashing $source ..."
key=$(
    {
        quasar-deploy --version
        cd "$source" && find . -type f ! -path './.cache/*' | LC_ALL=C sort | while IFS= read -r file; do sha256sum "$file"; done
    } | sha256sum | cut -c1-16
)
work=$models/$key
mkdir -p "$work"

# step OUTPUT COMMAND...: run COMMAND unless OUTPUT exists
step() {
    output=$1
    shift
    if [ -e "$output" ]; then
        echo "reusing $output"
    else
        "$@"
    fi
}

case $profile in
    cpu | cuda)
        step "$work/w8a8" quasar-deploy calibrate "$source" --output "$work/w8a8"
        ;;
    onnxruntime-gpu)
        step "$work/w8a8-static" quasar-deploy calibrate "$source" --activation static --output "$work/w8a8-static"
        step "$work/onnx" quasar-deploy export "$work/w8a8-static" --target onnx --format qdq --output "$work/onnx"
        ;;
    npu)
        step "$work/w8a8" quasar-deploy calibrate "$source" --output "$work/w8a8"
        step "$work/npu" quasar-deploy export "$work/w8a8" --target npu --output "$work/npu"
        ;;
esac

# a relative link, so that it resolves wherever the volume is mounted; replaced atomically
ln -sfn "$key/$target" "$models/.$profile.new"
mv -T "$models/.$profile.new" "$models/$profile"
echo "prepared $models/$profile -> $key/$target"
