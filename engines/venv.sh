#!/usr/bin/env bash
# Build (or reuse) the venv of one serving engine from its pinned requirements, and print its path.
#
#   engines/venv.sh vllm            # -> ~/.cache/tapdraft/engines/vllm-<hash>/
#
# The venv is keyed by a hash of engines/NAME.txt, so a changed pin builds a new one and an
# unchanged one is reused (a machine that keeps ~/.cache keeps it). A venv is used only once its
# `.complete` stamp exists: a build killed half-way is rebuilt, never half-used; concurrent callers take
# turns. The engine's plugin package (engines/NAME_plugin, when there is one) is reinstalled whenever its
# files change.
# --root DIR puts the venvs elsewhere. Progress goes to stderr; stdout is the venv path alone.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${HOME}/.cache/tapdraft/engines"
name=""
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) name="$1"; shift ;;
  esac
done
spec="$here/$name.txt"
if [ -z "$name" ] || [ ! -f "$spec" ]; then
  echo "error: name an engine with a spec in engines/ (one of: $(cd "$here" && ls *.txt | sed 's/\.txt$//' | tr '\n' ' '))" >&2
  exit 2
fi
key="$(sha256sum "$spec" | cut -c1-12)"
venv="$root/$name-$key"
python="${PYTHON:-python3}"

# One build or plugin install at a time per venv: a second caller (another test process, a benchmark) waits here
# and then finds the venv complete, instead of deleting the one being built.
mkdir -p "$root"
exec 9>"$venv.lock"
flock 9

if [ ! -f "$venv/.complete" ]; then
  echo "building the $name venv in $venv (a few minutes, once)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$spec" >&2
  # vLLM's CPU wheel pulls torchvision/torchaudio/torchcodec builds made for another torch: they
  # break `import vllm` and transformers' processors on this one. tapdraft's tests need none of them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -m pip freeze > "$venv/freeze.txt"
  touch "$venv/.complete"
fi

plugin="$here/${name}_plugin"
if [ -d "$plugin" ]; then
  stamp="$(cd "$plugin" && find . -type f -not -path '*/__pycache__/*' -not -path '*.egg-info*' -not -path './build/*' | sort | xargs sha256sum | sha256sum | cut -c1-12)"
  if [ "$(cat "$venv/.plugin" 2>/dev/null)" != "$stamp" ]; then
    echo "installing $(basename "$plugin") into the $name venv" >&2
    tmp="$(mktemp -d)"; cp -r "$plugin/." "$tmp/"
    # a stale setuptools build/ (left by an earlier `pip install engines/..._plugin`) would be installed instead
    # of the sources: cp gives both the same mtime, and build_py copies a source only when it is newer
    rm -rf "$tmp/build" "$tmp"/*.egg-info
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation "$tmp" >&2
    rm -rf "$tmp"
    echo "$stamp" > "$venv/.plugin"
  fi
fi
echo "$venv"
