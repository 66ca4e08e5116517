#!/usr/bin/env bash
# mypy --strict over the installed layout: actors/ and transport/ are aurora.actors
# and aurora.transport, which mypy cannot see through the editable-install hook, so
# we lay the package out as it installs (symlinks) under build/typecheck.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=build/typecheck
rm -rf "$stage" && mkdir -p "$stage/aurora"
for f in aurora/*; do ln -s "../../../$f" "$stage/aurora/$(basename "$f")"; done
ln -s ../../../actors "$stage/aurora/actors"
ln -s ../../../transport "$stage/aurora/transport"
exec "${PYTHON:-.venv/bin/python}" -m mypy --config-file pyproject.toml "$stage/aurora" "$@"
