#!/usr/bin/env bash
# Test suite: creates or reuses .venv, builds the extension, runs pytest (slow scenarios excluded).
. "$(dirname "$0")/env.sh"
exec python -m pytest -q -m "not slow" tests "$@"
