#!/usr/bin/env bash
# Main job: offline generation on the embedded default model (no download needed).
. "$(dirname "$0")/env.sh"
exec python examples/offline.py "$@"
