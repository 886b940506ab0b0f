#!/usr/bin/env bash
# Regenerate swarmtrain/wire/*_pb2*.py from proto/ (the generated files are committed, never edited).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/swarmtrain/wire/*.proto
