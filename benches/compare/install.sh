#!/usr/bin/env bash
# Installs the engines Durastep is compared with, pinned, into benches/compare/.deps/
# (git-ignored; nothing is vendored). Idempotent: a second run with the same pins
# does nothing.
#   graphile-worker (npm)      -> .deps/node
#   dbos (DBOS Transact, PyPI) -> .deps/venv
set -euo pipefail

GRAPHILE_WORKER_VERSION="${GRAPHILE_WORKER_VERSION:-0.18.0}"
DBOS_VERSION="${DBOS_VERSION:-3.4.0}"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
deps="$here/.deps"
mkdir -p "$deps/node"

# graphile-worker
node_dir="$deps/node"
installed_gw="$(node -p "try{require('$node_dir/node_modules/graphile-worker/package.json').version}catch(e){''}" 2>/dev/null || true)"
if [ "$installed_gw" != "$GRAPHILE_WORKER_VERSION" ]; then
  if [ ! -f "$node_dir/package.json" ]; then
    printf '{ "name": "durastep-compare-deps", "private": true, "version": "0.0.0" }\n' > "$node_dir/package.json"
  fi
  echo "install.sh: installing graphile-worker@$GRAPHILE_WORKER_VERSION" >&2
  (cd "$node_dir" && npm install --no-audit --no-fund --save-exact --loglevel=error \
    "graphile-worker@$GRAPHILE_WORKER_VERSION" "pg@8.23.1")
else
  echo "install.sh: graphile-worker@$installed_gw already installed" >&2
fi

# DBOS Transact for Python
venv="$deps/venv"
if [ ! -x "$venv/bin/python" ]; then
  echo "install.sh: creating venv" >&2
  python3 -m venv "$venv"
fi
installed_dbos="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("dbos"))' 2>/dev/null || true)"
if [ "$installed_dbos" != "$DBOS_VERSION" ]; then
  echo "install.sh: installing dbos==$DBOS_VERSION" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "dbos==$DBOS_VERSION"
else
  echo "install.sh: dbos==$installed_dbos already installed" >&2
fi
