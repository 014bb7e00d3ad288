#!/usr/bin/env bash
# The main job: set up, then fine-tune on the bundled Austen corpus (configs/quickstart.toml)
# with ddp.so on 2 local ranks (1 intra-op thread each), printing the loss as it falls, time per
# epoch and held-out perplexity, then writes the run's report (runs/quickstart-<date>/report.md)
# and points runs/quickstart at the run.
# Extra arguments go to the trainer, e.g. tools/quickstart.sh --set train.epochs=1
# (WEFT_QUICKSTART_NPROC=1 runs it in one process with single.so instead).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/build_env.sh   # PyTorch's wheel by default (WEFT_LIBTORCH=DIR: another LibTorch 2.5+)
tools/setup.sh
# Each run gets its own directory, so earlier runs are never overwritten.
nproc=${WEFT_QUICKSTART_NPROC:-2}
plugin=ddp
[[ "$nproc" == 1 ]] && plugin=single
out="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
"$WEFT_BUILD_DIR/trainer" --config configs/quickstart.toml --plugin "$plugin" --nproc "$nproc" --set train.out_dir="$out" "$@"
# The run as a document: loss curves, time per epoch, tokens/s, perplexity, config, command.
"$WEFT_BUILD_DIR/trainer" report "$out"
# runs/quickstart names the latest quick start: the classification examples start from its final/
# (configs/fortunes-topic.toml, configs/austen-novel.toml). A real folder there (a run of
# configs/quickstart.toml itself, whose out_dir it is) is left as it is.
if [[ -L runs/quickstart || ! -e runs/quickstart ]]; then
  ln -sfn "$(basename "$out")" runs/quickstart
  echo "quickstart: runs/quickstart -> $out"
fi
