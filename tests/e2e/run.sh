#!/usr/bin/env bash
# End-to-end tests of `spark-run serve` with the official `openai` Python package.
# Creates a virtual environment in target/e2e-venv (once), installs openai, pytest, requests and jsonschema,
# builds the release binary if $SPARK_RUN is not set and it is missing, and runs pytest.
# Extra arguments go to pytest (e.g. -k tool_call).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
export SPARK_RUN="${SPARK_RUN:-$ROOT/target/release/spark-run}"
if [ ! -x "$SPARK_RUN" ]; then
  CARGO_TARGET_DIR="$ROOT/target" cargo build --release -p spark-run
fi
VENV="$ROOT/target/e2e-venv"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check openai pytest requests jsonschema
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/e2e "$@"
