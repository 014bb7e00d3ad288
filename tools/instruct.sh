#!/usr/bin/env bash
# Instruction tuning of the bundled model (configs/instruct.toml): LoRA on SmolLM2-135M-Instruct with
# the bundled instruction set under ddp.so on 2 local ranks. Asks the 4 questions of
# data/austen-instruct/questions.jsonl (passages the set does not hold) before and after, with the
# expected answers; the run reports the held-out loss on the assistant's tokens before training and
# after. Run tools/setup.sh first (or tools/quickstart.sh, which runs it). Extra arguments go to the
# trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/build_env.sh
out="runs/instruct-$(date +%Y%m%d-%H%M%S)"
ask() {  # the greedy answer to each question, then the one in the data
  python3 -c 'import json,sys
for line in open(sys.argv[1]):
    m = json.loads(line)["messages"]
    print(json.dumps([m[1]["content"], m[2]["content"]]))' data/austen-instruct/questions.jsonl |
  while read -r pair; do
    question=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])[0])' "$pair")
    expected=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])[1])' "$pair")
    lines=$(printf '%s\n' "$question" | wc -l)  # generate prints the token ids, the question, the reply
    echo "Q: ${question%%$'\n'*} [a passage of ${#question} characters]"
    echo "A: $("$WEFT_BUILD_DIR/trainer" generate --config configs/instruct.toml --chat --prompt "$question" \
                --log-level warn "$@" | tail -n +$((2 + lines)))"
    echo "expected: $expected"
  done
}
echo "instruct: the pretrained model's answers (greedy):"
ask
"$WEFT_BUILD_DIR/trainer" --config configs/instruct.toml --plugin ddp --nproc 2 --set train.out_dir="$out" "$@"
echo "instruct: after tuning ($out/final, LoRA):"
ask --set model.adapter="$out/final"
"$WEFT_BUILD_DIR/trainer" report "$out"
