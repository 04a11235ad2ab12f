# Sourced by scripts/run and scripts/test: create .venv and install summasim into it.
#
#   SUMMASIM_MPI=wheel   (default) MPI from the `mpich` wheel on PyPI: no system package needed
#   SUMMASIM_MPI=system  use the MPI on PATH (mpicc/mpiexec): mpi4py is built against it
#   SUMMASIM_PYTHON      the interpreter to create the venv with (default python3)
#   SUMMASIM_VENV        where the venv lives (default .venv in the repository)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SUMMASIM_VENV:-$ROOT/.venv}"
MPI_KIND="${SUMMASIM_MPI:-wheel}"
case "$MPI_KIND" in
  wheel) EXTRAS="mpich,test,plot" ;;
  system) EXTRAS="test,plot" ;;
  *) echo "SUMMASIM_MPI must be 'wheel' or 'system', got '$MPI_KIND'" >&2; exit 2 ;;
esac
say() { echo "summasim setup: $*" >&2; }
# One set-up at a time: a second ./scripts/run or ./scripts/test waits here for the
# first to finish building the venv, instead of using it half-built.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
if command -v flock >/dev/null 2>&1 && ! flock -n 9; then
  say "waiting for another set-up of $VENV to finish"
  flock 9
fi
# reinstall only when the package metadata or the MPI choice changed
STAMP="$VENV/.summasim-installed"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | cksum | cut -d' ' -f1)-$MPI_KIND"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  rm -f "$STAMP"                  # a set-up cut short stays unfinished: it is redone
  if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then   # absent or half-built
    say "creating the virtual environment $VENV"
    "${SUMMASIM_PYTHON:-python3}" -m venv --clear "$VENV"
  fi
  say "installing summasim and its dependencies ($EXTRAS; MPI: $MPI_KIND); this takes a minute the first time"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  if [ "$MPI_KIND" = system ]; then
    "$VENV/bin/python" -m pip install --quiet --no-binary=mpi4py mpi4py
  fi
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[$EXTRAS]"
  echo "$WANT" > "$STAMP"
  say "ready"
fi
# byte-compile the project once: every MPI rank of every launch imports it, and with
# PYTHONDONTWRITEBYTECODE set each would compile it again
"$VENV/bin/python" -m compileall -q -j 0 "$ROOT/summasim" "$ROOT/tests" "$ROOT/mpi_tests" >/dev/null
exec 9>&-
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
cd "$ROOT"
