#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for FUZZ_SECONDS each (default 60),
# on the stable toolchain: cargo-fuzz passes nightly-only flags (-Zsanitizer,
# coverage instrumentation), which stable rustc accepts with RUSTC_BOOTSTRAP=1.
# Installs cargo-fuzz from crates.io if it is missing. Corpora are kept in
# fuzz/corpus/<target> (ignored by git) and grow across runs; a crash is saved in
# fuzz/artifacts/<target>/ and fails the script. See fuzz/README.md.
#
#   scripts/fuzz-smoke.sh                      # 1 minute per target
#   FUZZ_SECONDS=3600 scripts/fuzz-smoke.sh    # 1 hour per target
#   scripts/fuzz-smoke.sh payload_json         # one target
set -euo pipefail

cd "$(dirname "$0")/../fuzz"
seconds="${FUZZ_SECONDS:-60}"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(payload_json event_value names)
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

for target in "${targets[@]}"; do
    echo "== $target, ${seconds}s"
    # -max_len: the generators read their choices from the input, so longer
    # inputs mean bigger cases; -rss_limit_mb: 10 MB cases parse to ~1 GB of Values.
    cargo fuzz run "$target" -- -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=4096 -print_final_stats=1
done
