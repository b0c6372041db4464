#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for bench/gpu_zoo.sh (its image has torch, numpy, pyyaml,
# typer, rich, filelock, prometheus-client and pytest, but no registry), at the versions this
# checkout's .venv holds, for its Python 3.12, into .whl/ (which .git/info/exclude must ignore).
# Then carry .whl and start the command there with the install line this prints.
#
#   bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
names=(boto3 botocore s3transfer jmespath pydantic pydantic_core annotated-types typing-inspection
       cryptography cffi pycparser plotly tlparse pyseccomp)
platforms=()
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${p}_x86_64")
done
mkdir -p .whl
for name in "${names[@]}"; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$name==$version"
done
du -sh .whl
echo 'there: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site'
