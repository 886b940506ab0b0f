#!/usr/bin/env bash
# Real tokenizer files for the tests, from packages on PyPI (no model hub): GPT-2's BPE ranks from the
# openai-whisper sdist and a SentencePiece model from the mistral-common wheel, extracted into DIR.
#   scripts/fetch_tokenizer_assets.sh DIR [PYTHON]
set -euo pipefail
dir=$1
py=${2:-python3}
[ -s "$dir/gpt2.tiktoken" ] && [ -s "$dir/mistral-v1.model" ] && exit 0
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: openai-whisper==20250625 -d "$tmp"
"$py" -m pip download -q --no-deps mistral-common==1.13.1 -d "$tmp"
tar -xzf "$tmp"/openai_whisper-20250625.tar.gz -C "$tmp" openai_whisper-20250625/whisper/assets/gpt2.tiktoken
"$py" - "$tmp" "$dir" <<'PY'
import sys, zipfile, pathlib
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(out / "gpt2.tiktoken").write_bytes((tmp / "openai_whisper-20250625/whisper/assets/gpt2.tiktoken").read_bytes())
with zipfile.ZipFile(next(tmp.glob("mistral_common-*.whl"))) as z:
    (out / "mistral-v1.model").write_bytes(z.read("mistral_common/data/tokenizer.model.v1"))
PY
