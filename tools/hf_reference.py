"""weft's Llama and LoRA adapters against the implementations users trust: transformers'
LlamaForCausalLM and PEFT (PyPI, tools/requirements.txt). Run by ctest as
Reference.TransformersAndPeftComputeWeftsLogits:

    python3 tools/hf_reference.py HF_LOGITS WORK_DIR

For small random models (tied embeddings with Llama 3's RoPE scaling and grouped-query attention;
untied with plain RoPE, multi-head attention and a head_dim of its own), each in fp32 with random
norm weights:
  1. transformers saves the model (config.json as transformers 5 writes it: rope_parameters) and
     weft's logits for the same tokens equal transformers' (hf_logits MODEL);
  2. weft saves it again (save_pretrained: its own config.json) and transformers' logits from
     that equal weft's;
  3. PEFT adds LoRA adapters to all seven projections with random A and B and saves them; weft
     loads them (--adapter) and its logits equal PEFT's;
  4. weft writes adapters of its own (--write-adapter, random A and B) and PEFT loads them
     (PeftModel.from_pretrained): PEFT's logits equal weft's;
  5. PEFT trains AdaLoRA adapters for a few steps (its allocator masks triplets to the final
     budget: rank_pattern, tensors truncated to the kept triplets) and saves them; weft's rank
     allocator, given the parameters and gradients PEFT's saw at each step, leaves the same Lambda
     (the same masks) after every step and ends with the same pattern; weft loads the saved
     adapter and its logits equal PEFT's;
  6. weft writes AdaLoRA adapters (random P, Lambda, Q; a rank pattern pruning one layer to rank 0)
     and PEFT loads them: PEFT's logits equal weft's;
  7. LlamaForSequenceClassification (3 classes, and a 1-output regression head) on right-padded
     rows of different lengths: weft's head outputs at each row's last token equal transformers'
     pooled logits, and transformers loads weft's save of the classifier to the same logits.
Equal means the largest difference is at most 1e-5 of the largest logit (fp32, different
summation orders). Exit status 0 when every comparison holds, 1 otherwise."""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers
import peft
from transformers import LlamaConfig, LlamaForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-5


def main():
    hf_logits, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    cases = {
        "tied-llama3-rope-gqa": dict(tie_word_embeddings=True, num_key_value_heads=2,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                     rope_theta=500000.0),
        "untied-rope-mha-head-dim": dict(tie_word_embeddings=False, num_key_value_heads=4, head_dim=24,
                                         rope_theta=10000.0),
    }
    failures = 0

    def compare(what, weft_logits, reference):
        nonlocal failures
        diff = (weft_logits - reference).abs().max().item()
        scale = reference.abs().max().item()
        ok = diff <= TOLERANCE * max(1.0, scale)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {what}: largest difference {diff:.3g} (largest logit {scale:.3g})")

    def weft(model_dir, *options):
        out = os.path.join(work, "weft-logits.safetensors")
        subprocess.run([hf_logits, model_dir, tokens_file, out, *options], check=True)
        return load_file(out)["logits"]

    for name, shape in cases.items():
        torch.manual_seed(hash(name) % 1000)
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5, **shape)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.copy_(1 + 0.3 * torch.randn_like(p))
        model_dir = os.path.join(work, name, "hf")
        model.save_pretrained(model_dir)
        written = json.load(open(os.path.join(model_dir, "config.json")))
        print(f"{name}: transformers wrote {'rope_parameters' if 'rope_parameters' in written else 'rope_theta/rope_scaling'}")
        tokens = torch.randint(0, 256, (2, 40))
        tokens_file = os.path.join(work, "tokens.safetensors")
        save_file({"tokens": tokens}, tokens_file)
        with torch.no_grad():
            reference = model(tokens).logits.float()

        # 1 and 2: the base model, both ways.
        resaved = os.path.join(work, name, "weft-saved")
        compare(f"{name}: weft loads transformers' model", weft(model_dir, "--save-pretrained", resaved), reference)
        reloaded = LlamaForCausalLM.from_pretrained(resaved).eval()
        with torch.no_grad():
            compare(f"{name}: transformers loads weft's save", reloaded(tokens).logits.float(), reference)

        # 3: PEFT's adapter in weft.
        base = LlamaForCausalLM.from_pretrained(model_dir).eval()
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
        peft_model = peft.get_peft_model(base, lora).eval()
        peft_dir = os.path.join(work, name, "peft-adapter")
        peft_model.save_pretrained(peft_dir)
        with torch.no_grad():
            peft_logits = peft_model(tokens).logits.float()
        compare(f"{name}: weft loads PEFT's LoRA adapter", weft(model_dir, "--adapter", peft_dir), peft_logits)
        if (peft_logits - reference).abs().max().item() < 1e-3:
            print(f"FAIL {name}: PEFT's random adapter changes nothing; the comparison above means nothing")
            failures += 1

        # 4: weft's adapter in PEFT.
        weft_dir = os.path.join(work, name, "weft-adapter")
        weft_logits = weft(model_dir, "--write-adapter", weft_dir, "8", "16", "5", ",".join(TARGETS))
        base = LlamaForCausalLM.from_pretrained(model_dir).eval()
        loaded = peft.PeftModel.from_pretrained(base, weft_dir).eval()
        with torch.no_grad():
            compare(f"{name}: PEFT loads weft's LoRA adapter", loaded(tokens).logits.float(), weft_logits)
        if (weft_logits - reference).abs().max().item() < 1e-3:
            print(f"FAIL {name}: weft's random adapter changes nothing; the comparison above means nothing")
            failures += 1
        # 5: PEFT's AdaLoRA adapter, trained a few steps so that its allocator masked triplets
        # (rank_pattern, tensors truncated to the kept ones), in weft.
        base = LlamaForCausalLM.from_pretrained(model_dir)
        ada = peft.AdaLoraConfig(init_r=6, target_r=2, tinit=1, tfinal=2, deltaT=1, total_step=8, lora_alpha=8,
                                 lora_dropout=0.0, target_modules=TARGETS)
        ada_model = peft.get_peft_model(base, ada)
        optimizer = torch.optim.Adam([p for p in ada_model.parameters() if p.requires_grad], lr=0.05)
        inner = ada_model.base_model.model
        trace, masked = {}, {}
        for step in range(8):
            ada_model.train()
            ada_model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            for n, p in inner.named_parameters():  # what PEFT's allocator is about to see
                if "lora_" in n and p.requires_grad:
                    key = f"{step}.{n.replace('.default', '')}"
                    trace[key], trace[key + ".grad"] = p.detach().clone(), p.grad.detach().clone()
            ada_model.base_model.update_and_allocate(step)
            for n, p in inner.named_parameters():
                if n.endswith("lora_E.default"):
                    masked[f"{step}.{n.replace('.default', '')}"] = p.detach().clone()
            optimizer.zero_grad()
        # 5a: weft's RankAllocator on the same parameters and gradients masks the same triplets at
        # every step (Lambda after each update_and_allocate equal) and ends with PEFT's pattern.
        trace["config"] = torch.tensor([6, 2, 1, 2, 1, 8, 8], dtype=torch.int64)
        trace["betas"] = torch.tensor([ada.beta1, ada.beta2], dtype=torch.float64)
        trace["lora_alpha"] = torch.tensor([8.0], dtype=torch.float64)
        trace["targets"] = torch.tensor(list(",".join(TARGETS).encode()), dtype=torch.uint8)
        trace_file = os.path.join(work, name, "adalora-trace.safetensors")
        replay_file = os.path.join(work, name, "adalora-replay.safetensors")
        save_file({k: v.contiguous() for k, v in trace.items()}, trace_file)
        subprocess.run([hf_logits, model_dir, tokens_file, os.path.join(work, "unused.safetensors"), "--replay-adalora",
                        trace_file, replay_file], check=True)
        replayed = load_file(replay_file)
        differing = [k for k, v in masked.items() if not torch.equal(replayed[k], v)]
        peft_pattern = {k.replace(".default", "")[: -len(".lora_E")]: v
                        for k, v in ada_model.peft_config["default"].rank_pattern.items()}
        weft_pattern = {k[: -len(".pattern")]: [bool(x) for x in v.tolist()] for k, v in replayed.items()
                        if k.endswith(".pattern")}
        ok = not differing and weft_pattern == peft_pattern
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: weft's rank allocator on PEFT's gradients: Lambda after "
              f"{len(masked)} layer-steps of update_and_allocate {'equal' if not differing else 'differs: ' + str(differing[:3])}, "
              f"final rank pattern {'equal' if weft_pattern == peft_pattern else 'differs'} "
              f"({sum(sum(f) for f in peft_pattern.values())} of {6 * len(peft_pattern)} triplets kept)")
        ada_model.eval()
        ranks = [sum(flags) for flags in ada_model.peft_config["default"].rank_pattern.values()]
        ada_dir = os.path.join(work, name, "peft-adalora")
        ada_model.save_pretrained(ada_dir)
        with torch.no_grad():
            ada_logits = ada_model(tokens).logits.float()
        compare(f"{name}: weft loads PEFT's AdaLoRA adapter (ranks {ranks})", weft(model_dir, "--adapter", ada_dir),
                ada_logits)
        change = (ada_logits - reference).abs().max().item()
        if change < 1e-3 or sum(ranks) != 2 * len(ranks):
            print(f"FAIL {name}: PEFT's AdaLoRA run did not change the model ({change:.3g}) or keep its budget ({ranks})")
            failures += 1

        # 6: weft's AdaLoRA adapter (random values, a rank pattern with a layer pruned to rank 0) in PEFT.
        weft_ada_dir = os.path.join(work, name, "weft-adalora")
        weft_logits = weft(model_dir, "--write-adalora", weft_ada_dir, "6", "2", "8", "7", ",".join(TARGETS))
        base = LlamaForCausalLM.from_pretrained(model_dir).eval()
        loaded = peft.PeftModel.from_pretrained(base, weft_ada_dir).eval()
        with torch.no_grad():
            compare(f"{name}: PEFT loads weft's AdaLoRA adapter", loaded(tokens).logits.float(), weft_logits)
        if (weft_logits - reference).abs().max().item() < 1e-3:
            print(f"FAIL {name}: weft's random AdaLoRA adapter changes nothing; the comparison above means nothing")
            failures += 1

        # 7: sequence classification (LlamaForSequenceClassification: score.weight, no bias, pooled
        # at each row's last non-pad token) on right-padded rows of different lengths, 3 classes and
        # a regression head: weft's head outputs at each row's last token equal transformers'
        # pooled logits, and transformers loads weft's save of the classifier.
        for labels in (3, 1):
            torch.manual_seed(labels)
            pad = 255  # never drawn below
            id2label = {i: f"class{i}" for i in range(labels)} if labels > 1 else {0: "score"}
            cls_config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
                                     pad_token_id=pad, num_labels=labels, id2label=id2label,
                                     label2id={v: k for k, v in id2label.items()}, **shape)
            classifier = transformers.LlamaForSequenceClassification(cls_config).eval()
            with torch.no_grad():
                for n, p in classifier.named_parameters():
                    if n.endswith("norm.weight"):
                        p.copy_(1 + 0.3 * torch.randn_like(p))
            cls_dir = os.path.join(work, name, f"hf-classifier-{labels}")
            classifier.save_pretrained(cls_dir)
            lengths = [40, 23, 7, 1]
            rows = torch.full((len(lengths), 40), pad, dtype=torch.int64)
            for r, n in enumerate(lengths):
                rows[r, :n] = torch.randint(0, 250, (n,))
            tokens_file = os.path.join(work, "tokens.safetensors")
            save_file({"tokens": rows}, tokens_file)
            with torch.no_grad():
                pooled = classifier(rows).logits.float()
            cls_saved = os.path.join(work, name, f"weft-classifier-{labels}")
            weft_all = weft(cls_dir, "--save-pretrained", cls_saved)
            weft_pooled = torch.stack([weft_all[r, n - 1] for r, n in enumerate(lengths)])
            kind = f"{labels} classes" if labels > 1 else "regression"
            compare(f"{name}: weft's classification head ({kind}) at each row's last token", weft_pooled, pooled)
            reloaded = transformers.LlamaForSequenceClassification.from_pretrained(cls_saved).eval()
            ok = reloaded.config.num_labels == labels and reloaded.config.id2label == id2label
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name}: weft's classifier config.json keeps num_labels {labels} and id2label")
            with torch.no_grad():
                compare(f"{name}: transformers loads weft's classifier ({kind})", reloaded(rows).logits.float(), pooled)
    print("all comparisons hold" if failures == 0 else f"{failures} comparison(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
