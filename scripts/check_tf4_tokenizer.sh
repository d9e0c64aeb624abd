#!/usr/bin/env bash
# Must show 3 of issue 18: the tokenizer finetune writes (RUN_DIR/adapter, RUN_DIR/merged) loads in the last
# transformers 4 release with the same token ids as the pinned transformers 5.
#
#   bash scripts/check_tf4_tokenizer.sh RUN_DIR [more tokenizer dirs...]
#
# Builds its own venv ONCE (transformers 4.57.6 + tokenizers + jinja2 from PyPI; cached in
# ${FINETUNE_TF4_VENV:-~/.cache/finetune/tf4-venv}), then runs scripts/tokenizer_ids.py under both
# interpreters and compares what they print. tests/integration/test_export_gguf.py runs the same comparison
# when that venv exists.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py5="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py5" ] || py5=/work/main/.venv/bin/python
venv="${FINETUNE_TF4_VENV:-$HOME/.cache/finetune/tf4-venv}"
tf4_version="4.57.6"   # the last transformers 4 release (pip index versions transformers)
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import transformers as t; assert t.__version__ == '$tf4_version'" 2>/dev/null; then
  echo "building $venv (transformers==$tf4_version), once"
  rm -rf "$venv.tmp" && "$py5" -c "import sys; print(sys.base_prefix)" >/dev/null
  base_python="$("$py5" -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin", "python3"))')"
  "$base_python" -m venv "$venv.tmp"
  "$venv.tmp/bin/pip" install -q "transformers==$tf4_version" "tokenizers==0.22.2" "jinja2==3.1.6"
  rm -rf "$venv" && mv "$venv.tmp" "$venv"
fi
[ $# -ge 1 ] || { echo "usage: $0 RUN_DIR|TOKENIZER_DIR ..." >&2; exit 2; }
dirs=()
for d in "$@"; do
  if [ -f "$d/adapter/tokenizer_config.json" ]; then dirs+=("$d/adapter"); [ -d "$d/merged" ] && dirs+=("$d/merged")
  else dirs+=("$d"); fi
done
cd "$here"
"$py5" scripts/tokenizer_ids.py --compare "$venv/bin/python" "${dirs[@]}"
