# Source this: creates or reuses .venv, installs the pinned requirements and builds deepinfer._C.
set -e
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.requirements.sha"
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-nodeps.txt" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  # torch alone first so no later package can resolve it to a CUDA build.
  pip install -q "$(grep '^torch==' "$ROOT/requirements.txt")"
  pip install -q -r "$ROOT/requirements.txt"
  pip install -q --no-deps -r "$ROOT/requirements-nodeps.txt"
  echo "$WANT" > "$STAMP"
fi
# The repo itself is the package (editable): a .pth puts it on the venv's path.
python -c "import site, sys; open(site.getsitepackages()[0] + '/deepinfer-dev.pth', 'w').write(sys.argv[1])" "$ROOT"
(cd "$ROOT" && python setup.py -q build_ext --inplace)
python -c "import deepinfer._C" 
cd "$ROOT"
