#!/usr/bin/env bash
# The main job: set up, then fine-tune on the bundled Austen corpus (configs/quickstart.toml),
# printing the loss as it falls, time per epoch and held-out perplexity.
# Extra arguments go to the trainer, e.g. tools/quickstart.sh --set train.epochs=1
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
# Each run gets its own directory, so earlier runs are never overwritten.
exec build/trainer --config configs/quickstart.toml --set train.out_dir="runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
