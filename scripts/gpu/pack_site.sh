#!/usr/bin/env bash
# The Python packages a GPU machine without a package index lacks (Ray, Prefect and their
# dependencies; the image has torch, transformers, pyarrow, aiohttp, grpcio, ...), packed into
# ONE file small enough to travel with a run: .gpu_wheels/g/site.tar.xz (about 49 MiB).
#
# The cp312 manylinux wheels are installed here into a target directory (pip installs for
# another platform with --target), then what rollflow never imports is dropped: Ray's Java
# worker (ray/jars, 31 MiB compressed), RLlib, Data, Tune, Train and LLM; the web UIs of
# Prefect's server and Ray's dashboard (rollflow's ephemeral Prefect server and local Ray head
# serve none); the symbol tables of Ray's and the router's binaries (strip --strip-unneeded:
# 35 MiB of Ray's 119, 21 of the router's 92; Ray still runs). Scripts get a
# `python3` shebang. xz packs the binaries (raylet, gcs_server) far tighter than a wheel's
# zip: the repacked Ray wheel alone would be 44.6 MiB, this whole set is 49 MiB.
# On the GPU machine: `tar -C /tmp/site -xJf site.tar.xz`, PYTHONPATH=/tmp/site, PATH+=
# /tmp/site/bin (scripts/gpu/e2e.sh does it). The list: pip's resolution of the project's
# runtime dependencies for Python 3.12, minus what KINDS.md lists in the image.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=${PIP:-.venv/bin/pip}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
cat > "$WORK/need.txt" <<'EOF'
ray==2.60.0
prefect==3.8.8
fastapi==0.150.0
uvicorn==0.54.0
pydantic==2.14.3
pydantic_core==2.50.4
pydantic-extra-types==2.11.1
pydantic-settings==2.16.3
annotated-types==0.8.0
typing-inspection==0.4.5
starlette==1.10.0
math-verify==0.9.0
latex2sympy2_extended==1.11.0
antlr4-python3-runtime==4.13.2
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
Mako==1.4.3
SQLAlchemy==2.1.9
aiosqlite==0.22.1
alembic==1.20.1
amplitude-analytics==1.3.0
apprise==1.13.1
asgi-lifespan==2.1.0
asyncpg==0.32.0
beartype==0.23.1
burner-redis==0.1.7
cachetools==7.3.2
cffi==2.1.1
coolname==5.0.0
cronsim==2.8
cryptography==50.0.2
cyclopts==5.4.0
dateparser==1.5.0
docker==7.2.0
docstring_parser==0.18.0
exceptiongroup==1.3.1
graphviz==0.21
greenlet==3.5.6
griffe==2.4.1
griffecli==2.4.1
griffelib==2.4.1
h2==4.4.1
hpack==4.2.0
httptools==0.9.0
hyperframe==6.1.0
jinja2-humanize-extension==0.4.0
jsonpatch==1.47
jsonpointer==3.12
oauthlib==4.0.1
opentelemetry-api==1.45.2
orjson==3.13.0
pendulum==3.3.0
py-key-value-aio==0.5.0
pycparser==3.12
pydocket==0.27.0
python-dotenv==1.2.4
python-json-logger==4.2.0
python-slugify==9.0.0
pytz==2026.6
readchar==4.2.2
redis==8.1.0
requests-oauthlib==2.0.0
rfc3339-validator==0.1.4
rich-rst==2.2.0
ruamel.yaml==0.19.1
ruamel.yaml.clib==0.2.15
semver==3.1.1
sniffio==1.3.1
text-unidecode==1.3
toml==0.10.2
tzdata==2026.6
tzlocal==5.4.5
uncalled-for==0.6.1
watchfiles==1.3.0
websockets==16.1.1
sglang-router==0.3.2
setproctitle==1.3.8
EOF
"$PIP" download -q --no-deps "${PLAT[@]}" -d "$WORK/dl" -r "$WORK/need.txt"
"$PIP" install -q --no-index --no-deps --no-compile "${PLAT[@]}" --target "$WORK/site" "$WORK"/dl/*.whl
rm -rf "$WORK"/site/ray/{jars,rllib,data,tune,train,llm} "$WORK"/site/bin/{tune,serve}
rm -rf "$WORK"/site/prefect/server/{ui,ui-v2} "$WORK"/site/ray/dashboard/client
strip --strip-unneeded "$WORK"/site/ray/_raylet.so "$WORK"/site/ray/core/src/ray/{gcs/gcs_server,raylet/raylet} \
  "$WORK"/site/sglang_router/sglang_router_rs.abi3.so
for f in "$WORK"/site/bin/*; do sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$f"; done
mkdir -p .gpu_wheels/g
tar -C "$WORK/site" -cf - . | xz -9 -T0 > .gpu_wheels/g/site.tar.xz
ls -l .gpu_wheels/g/site.tar.xz
