#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian/Ubuntu
# machine, then runs every test of the workspace. `.ci/run` calls this script.
#
#   scripts/test.sh                 # install what is missing, then cargo test --workspace --no-fail-fast
#   scripts/test.sh -p durastep     # arguments go to cargo test instead of --workspace
#   CI=true scripts/test.sh         # also cargo fmt --check, clippy -D warnings, cargo doc -D warnings
#
# What it installs (Debian packages, with apt-get; as root or through sudo):
# - faketime: tests/clock_skew.rs runs workers under libfaketime;
# - chromium and chromium-driver (scripts/install-browser.sh): the dashboard's
#   browser test drives headless Chromium;
# - postgresql, only when no server answers at DATABASE_URL and no server
#   binaries are installed (the tests then run on a throwaway cluster that
#   this script starts and removes).
# Each test creates its own database on the server DATABASE_URL names
# (default postgres://postgres@127.0.0.1:5432/postgres, trust auth).
set -euo pipefail
cd "$(dirname "$0")/.."

export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
updated=""

# apt-get install, running apt-get update first if the package lists are too old to know the package.
apt_install() {
    if $sudo apt-get install -y -qq "$@" >/dev/null 2>&1; then
        return 0
    fi
    if [[ -z $updated ]]; then
        $sudo apt-get update -qq >/dev/null 2>&1 || true
        updated=1
    fi
    $sudo apt-get install -y -qq "$@" >/dev/null 2>&1
}

if ! command -v cargo >/dev/null 2>&1; then
    echo "test.sh: cargo is missing: install Rust 1.94 or later (https://rustup.rs)" >&2
    exit 1
fi

if ! command -v faketime >/dev/null 2>&1; then
    echo "test.sh: installing faketime (for tests/clock_skew.rs)"
    apt_install faketime || { echo "test.sh: could not install faketime with apt-get" >&2; exit 1; }
fi

if [[ ! -x /usr/bin/chromium || ! -x /usr/bin/chromedriver ]]; then
    echo "test.sh: installing chromium and chromium-driver (for the dashboard's browser test)"
    bash scripts/install-browser.sh
fi

# A Postgres to test against: the one at DATABASE_URL, else a throwaway cluster.
hostport="${DATABASE_URL#*://}"
hostport="${hostport#*@}"
hostport="${hostport%%/*}"
hostport="${hostport%%\?*}"
host="${hostport%%:*}"
port="${hostport##*:}"
[[ $port == "$hostport" ]] && port=5432
throwaway=""
answers() { (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; }
if ! answers; then
    bindir=""
    for candidate in "$(command -v initdb 2>/dev/null | xargs -r dirname)" \
        "$(pg_config --bindir 2>/dev/null || true)" $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [[ -n $candidate && -x $candidate/initdb && -x $candidate/pg_ctl ]]; then
            bindir="$candidate"
            break
        fi
    done
    if [[ -z $bindir ]]; then
        echo "test.sh: nothing answers at $host:$port and no Postgres is installed: installing postgresql"
        apt_install postgresql || { echo "test.sh: could not install postgresql with apt-get" >&2; exit 1; }
        bindir="$(ls -d /usr/lib/postgresql/*/bin | sort -V -r | head -n 1)"
    fi
    throwaway="$(mktemp -d "${TMPDIR:-/tmp}/durastep-test-pg.XXXXXX")"
    as=()
    if [[ $(id -u) -eq 0 ]]; then
        # initdb refuses to run as root.
        chown postgres:postgres "$throwaway"
        as=(runuser -u postgres --)
    fi
    asked="$host:$port"
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 55432)"
    "${as[@]}" "$bindir/initdb" -D "$throwaway/data" -U postgres --auth=trust -E UTF8 --no-sync >/dev/null
    "${as[@]}" "$bindir/pg_ctl" -D "$throwaway/data" -l "$throwaway/server.log" -w -t 60 \
        -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$throwaway -c max_connections=300" start >/dev/null
    trap '"${as[@]}" "$bindir/pg_ctl" -D "$throwaway/data" -m immediate -w stop >/dev/null 2>&1 || true; rm -rf "$throwaway"' EXIT
    export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
    echo "test.sh: nothing answered at $asked; testing on a throwaway cluster at $DATABASE_URL (in $throwaway, removed at exit)"
fi

if [[ ${CI:-} == true ]]; then
    echo "test.sh: cargo fmt --all --check"
    cargo fmt --all --check
    echo "test.sh: cargo clippy --workspace --all-targets -- -D warnings"
    cargo clippy --workspace --all-targets -- -D warnings
    echo "test.sh: cargo doc --workspace --no-deps (warnings denied)"
    RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
fi

# With CI set, the browser test fails instead of skipping when Chromium is missing.
# --no-fail-fast: one failing test binary does not hide the results of the others.
if [[ $# -eq 0 ]]; then
    set -- --workspace --no-fail-fast
fi
echo "test.sh: cargo test $*"
cargo test "$@"
