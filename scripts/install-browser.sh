#!/usr/bin/env bash
# Installs Debian's headless browser for crates/durastep-dashboard/tests/browser.rs:
# chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver).
# Idempotent and quiet: does nothing when both are present; prints only errors.
set -euo pipefail

if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    exit 0
fi
sudo=""
if [[ $(id -u) -ne 0 ]]; then
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
{ $sudo apt-get install -y -qq chromium chromium-driver \
    || { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium chromium-driver; }; } >/dev/null 2>&1 \
    || { echo "install-browser.sh: could not install chromium and chromium-driver with apt-get" >&2; exit 1; }
if [[ ! -x /usr/bin/chromium || ! -x /usr/bin/chromedriver ]]; then
    echo "install-browser.sh: apt-get succeeded but /usr/bin/chromium or /usr/bin/chromedriver is missing" >&2
    exit 1
fi
