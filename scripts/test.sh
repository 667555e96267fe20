#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff), then run the test suite, slow tests included.
# Fails on any failure, and when pytest collects no tests (its exit code 5).
# Extra arguments go to pytest, e.g. scripts/test.sh tests/spec -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Everything but the `full` tier (whole-flow runs past CI's time budget: scripts/test.sh -m full runs them).
# --durations: the slowest tests in the log, to keep the run inside its budget on slower CPUs
exec .venv/bin/python -m pytest -m "not full" --durations=25 "$@"
