#!/bin/sh
# Builds weft's quick-start corpus: Jane Austen's six novels, one JSON object per chapter.
#
# Usage: tools/fetch_austen.sh [OUT_DIR]      (default: <repo>/data/austen)
#
# Downloads Debian's r-cran-janeaustenr package with `apt-get download` (no R,
# no installation; the caller must have run `apt-get update`), unpacks it with
# dpkg-deb into a temporary directory, and converts the R lazy-load database
# holding the novels with tools/austen_to_jsonl.py (Python standard library
# only). Writes OUT_DIR/austen.jsonl and OUT_DIR/README.
#
# Idempotent: if OUT_DIR/README and OUT_DIR/austen.jsonl exist and the JSONL
# matches the SHA-256 recorded in the README, nothing is done.
set -eu

PACKAGE=r-cran-janeaustenr
PYTHON=/usr/bin/python3
TOOLS_DIR=$(cd "$(dirname "$0")" && pwd)
REPO_DIR=$(cd "$TOOLS_DIR/.." && pwd)
OUT_DIR=${1:-"$REPO_DIR/data/austen"}

die() { echo "fetch_austen: error: $*" >&2; exit 1; }

is_complete() {
    [ -f "$OUT_DIR/README" ] && [ -f "$OUT_DIR/austen.jsonl" ] || return 1
    recorded=$(sed -n 's/^sha256 austen.jsonl: //p' "$OUT_DIR/README")
    [ -n "$recorded" ] || return 1
    actual=$(sha256sum "$OUT_DIR/austen.jsonl" | cut -d' ' -f1)
    [ "$recorded" = "$actual" ]
}

if is_complete; then
    echo "austen: $OUT_DIR already complete ($(grep -c '' "$OUT_DIR/austen.jsonl") chapters); nothing to do"
    exit 0
fi

for tool in apt-get dpkg-deb sha256sum "$PYTHON"; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found (needs a Debian/Ubuntu system)"
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fetch_austen.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM
# apt-get download as root drops privileges to _apt, which must be able to write here.
if [ "$(id -u)" = 0 ] && id _apt >/dev/null 2>&1; then
    chown _apt "$WORK"
fi

if ! (cd "$WORK" && apt-get download -q "$PACKAGE") >"$WORK/apt.log" 2>&1; then
    cat "$WORK/apt.log" >&2
    die "'apt-get download $PACKAGE' failed (run 'apt-get update' first; the package is in Debian/Ubuntu main/universe)"
fi
set -- "$WORK"/"$PACKAGE"_*.deb
[ -f "$1" ] || die "apt-get download reported success but left no $PACKAGE .deb in $WORK"
DEB=$1
VERSION=$(dpkg-deb -f "$DEB" Version)

dpkg-deb -x "$DEB" "$WORK/root" || die "dpkg-deb -x $DEB failed"

# The novels live in the package's lazy-load data base (data/Rdata.rdx/.rdb in
# 1.0.0); pass every lazy-load database found, data/ first, and let the
# converter pick the one whose index holds all six novels.
old_ifs=$IFS
IFS='
'
set --
for rdx in $(find "$WORK/root" -name '*.rdx' | sort | awk '/\/data\//{print; next} {rest = rest $0 "\n"} END {printf "%s", rest}'); do
    set -- "$@" --db "${rdx%.rdx}"
done
IFS=$old_ifs
[ $# -gt 0 ] || die "no R lazy-load database (*.rdx) in $PACKAGE $VERSION"

mkdir -p "$OUT_DIR"
"$PYTHON" "$TOOLS_DIR/austen_to_jsonl.py" "$@" --out "$OUT_DIR" --source "$PACKAGE $VERSION (Debian)"
