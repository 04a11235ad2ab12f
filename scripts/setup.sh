# Sourced by scripts/run and scripts/test: create .venv and install summasim into it.
#
#   SUMMASIM_MPI=wheel   (default) MPI from the `mpich` wheel on PyPI: no system package needed
#   SUMMASIM_MPI=system  use the MPI on PATH (mpicc/mpiexec): mpi4py is built against it
#   SUMMASIM_PYTHON      the interpreter to create the venv with (default python3)
#   SUMMASIM_VENV        where the venv lives (default .venv in the repository)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SUMMASIM_VENV:-$ROOT/.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac   # relative to where it was asked for
PY="${SUMMASIM_PYTHON:-python3}"
MPI_KIND="${SUMMASIM_MPI:-wheel}"
case "$MPI_KIND" in
  wheel) EXTRAS="mpich,test,plot" ;;
  system) EXTRAS="test,plot" ;;
  *) echo "SUMMASIM_MPI must be 'wheel' or 'system', got '$MPI_KIND'" >&2; exit 2 ;;
esac
say() { echo "summasim setup: $*" >&2; }
# a set-up that cannot finish is the user's environment, not a failed check: exit 2
fail() { say "$*"; exit 2; }
check_python() {   # the interpreter exists and is Python 3.11 or newer
  local version
  version="$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)" \
    || fail "no Python at '$PY' (SUMMASIM_PYTHON): name an interpreter of 3.11 or newer"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || fail "'$PY' is Python $version; summasim needs 3.11 or newer: set SUMMASIM_PYTHON to one"
  echo "$version"
}
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
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
if [ -n "${SUMMASIM_PYTHON:-}" ] && [ -n "$HAVE" ]; then
  # an interpreter named for a venv made with another one: the venv is made anew
  WANT_PY="$(check_python)" || exit 2
  HAVE_PY="$("$VENV/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' \
             2>/dev/null || true)"
  if [ "$WANT_PY" != "$HAVE_PY" ]; then
    say "the venv $VENV runs Python ${HAVE_PY:-?}, SUMMASIM_PYTHON is $WANT_PY: making it anew"
    rm -f "$STAMP"
    HAVE=""
    "$PY" -m venv --clear "$VENV" || fail "could not make the venv $VENV with $PY (above: why)"
  fi
fi
if [ "$HAVE" != "$WANT" ]; then
  rm -f "$STAMP"                  # a set-up cut short stays unfinished: it is redone
  # another MPI than the venv was built for: pip would keep the mpich wheel and an
  # mpi4py built for the old one, so the venv is made anew
  if [ -n "$HAVE" ] && [ "${HAVE##*-}" != "$MPI_KIND" ]; then
    say "the venv $VENV was set up for MPI '${HAVE##*-}', not '$MPI_KIND': making it anew"
    check_python > /dev/null || exit 2
    "$PY" -m venv --clear "$VENV" || fail "could not make the venv $VENV with $PY (above: why)"
  fi
  if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then   # absent or half-built
    say "creating the virtual environment $VENV"
    check_python > /dev/null || exit 2
    "$PY" -m venv --clear "$VENV" || fail "could not make the venv $VENV with $PY (above: why)"
  fi
  say "installing summasim and its dependencies ($EXTRAS; MPI: $MPI_KIND); this takes a minute the first time"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip \
    || fail "pip could not upgrade itself in $VENV (above: why)"
  if [ "$MPI_KIND" = system ]; then
    "$VENV/bin/python" -m pip install --quiet --no-binary=mpi4py mpi4py \
      || fail "mpi4py did not build against the MPI on PATH (mpicc; above: why)"
  fi
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[$EXTRAS]" \
    || fail "pip could not install summasim into $VENV (above: why)"
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
