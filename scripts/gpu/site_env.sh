# Sourced by the GPU scripts (run from the repo root, with PY set): the packages the image
# lacks, unpacked into /tmp/site from .gpu_wheels/g/site.tar.xz (scripts/gpu/pack_site.sh)
# and any .gpu_wheels/*/megatron_core*.whl, then put on PYTHONPATH (with the repo) and
# PATH. Name .gpu_wheels in the run's `carry`.
SITE=/tmp/site
if [ -f .gpu_wheels/g/site.tar.xz ] && [ ! -d "$SITE/pydantic" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .gpu_wheels/g/site.tar.xz || exit 1
fi
MCORE=$(ls .gpu_wheels/*/megatron_core*.whl 2>/dev/null | head -n 1)
if [ -n "$MCORE" ] && [ ! -d "$SITE/megatron" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$MCORE" || exit 1
fi
[ -d "$SITE" ] && export PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH || export PYTHONPATH=$PWD
