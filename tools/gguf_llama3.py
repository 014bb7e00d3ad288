#!/usr/bin/env python3
"""A Llama 3 checkpoint through GGUF: weft's export read back by gguf-py and by weft. Run by ctest
as Reference.GgufLlama3ExportReadsBack:

    python3 tools/gguf_llama3.py HF_LOGITS TOKENIZER_ENCODE TRAINER CONFIG WORK_DIR TEXT_FILE

A small model of Llama 3's architecture (transformers' LlamaForCausalLM, seeded: 2 layers, hidden
64, 4 heads / 2 kv heads, Llama 3's RoPE scaling with factor 32, tied embeddings) with Llama 3's
real tokenizer (tools/llama3_tokenizer.py: 128,256 tokens, the split regex, BOS added by the
post-processor, Llama 3 Instruct's chat template and end tokens) is saved as an HF folder, then
`trainer export --type f32` writes it as GGUF. Checked:
1. gguf-py reads the file: llama metadata from the config; `tokenizer.ggml.pre` is llama-bpe, the
   128,256 tokens and their types, BOS 128000 added; the chat template is the tokenizer_config's;
   `rope_freqs.weight` holds the factors llama.cpp's converter computes (convert_hf_to_gguf.py's
   formula, in fp32) within 1e-6.
2. weft reads the file back (hf_logits): its logits equal transformers' on the HF folder within
   1e-5 of the largest (the RoPE scaling from rope_freqs, q and k un-permuted over 2 kv heads).
3. weft's tokenizer from the file's metadata (tokenizer_encode) gives HF tokenizers' ids on
   TEXT_FILE (from the tokenizer.json the file was made from).
Exit status 0 when every comparison holds, 1 otherwise."""
import json
import math
import os
import subprocess
import sys

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama3_tokenizer  # noqa: E402

TOLERANCE = 1e-5
# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template, as that file holds it.
CHAT_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                 "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                 "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                 "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def converter_rope_factors(config):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = config.rope_parameters  # transformers 5: rope_scaling and rope_theta live here
    base = rope["rope_theta"]
    dim = config.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def main():
    hf_logits, tokenizer_encode, trainer, config_file, work, text_file = sys.argv[1:7]
    os.makedirs(work, exist_ok=True)
    failures = 0
    folder = os.path.join(work, "llama3-small")
    os.makedirs(folder, exist_ok=True)
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    with open(tokenizer_json, "w", encoding="utf-8") as f:
        json.dump(llama3_tokenizer.build_tokenizer_json(llama3_tokenizer.meta_tokenizer()), f, ensure_ascii=False)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE}, f)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                         rms_norm_eps=1e-5, initializer_range=0.2)
    reference = LlamaForCausalLM(config).eval()
    reference.save_pretrained(folder)
    out = os.path.join(work, "llama3-small.f32.gguf")
    subprocess.run([trainer, "export", "--config", config_file, "--set", f"model.weights={folder}", "--set",
                    f"data.tokenizer={tokenizer_json}", "--set", "data.cache_dir=", "--log-level", "warn", "--out", out,
                    "--type", "f32"], check=True)

    # 1. gguf-py's view of the file.
    reader = gguf.GGUFReader(out)
    field = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
    expected_metadata = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
                         "llama.feed_forward_length": 160, "llama.attention.head_count": 4,
                         "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 500000.0,
                         "llama.rope.dimension_count": 16, "llama.context_length": 131072,
                         "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
                         "tokenizer.ggml.bos_token_id": 128000, "tokenizer.ggml.add_bos_token": True,
                         "tokenizer.ggml.add_eos_token": False, "tokenizer.chat_template": CHAT_TEMPLATE}
    for key, want in expected_metadata.items():
        got = field(key)
        if got != want and not (isinstance(want, float) and got is not None and abs(got - want) <= 1e-6 * abs(want)):
            print(f"FAIL metadata {key}: {got!r}, expected {want!r}")
            failures += 1
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    if len(tokens) != 128256 or tokens[128000] != "<|begin_of_text|>" or types[128000] != 3 or types[0] != 1:
        print(f"FAIL tokens: {len(tokens)} tokens, 128000 is {tokens[128000]!r} of type {types[128000]}")
        failures += 1
    tensors = {t.name: t for t in reader.tensors}
    factors = np.asarray(tensors["rope_freqs.weight"].data) if "rope_freqs.weight" in tensors else None
    expected_factors = converter_rope_factors(config).numpy()
    if factors is None or factors.shape != expected_factors.shape or \
            np.abs(factors - expected_factors).max() > 1e-6 * np.abs(expected_factors).max():
        print(f"FAIL rope_freqs.weight: {factors} vs llama.cpp's converter's {expected_factors}")
        failures += 1
    if "output.weight" in tensors or len(tensors) != 1 + 2 + 2 * 9:
        print(f"FAIL tensors: {sorted(tensors)}")
        failures += 1
    print(f"gguf-py: {len(tensors)} tensors, llama-bpe with {len(tokens)} tokens, rope_freqs "
          f"{'as' if factors is not None else 'not'} llama.cpp's converter computes them")

    # 2. weft reads its file back: transformers' logits on the HF folder.
    ids = torch.tensor([[128000, 791, 4320, 315, 279, 1917, 374, 1148, 433, 574, 13, 128009],
                        [40, 1097, 264, 1890, 11, 7000, 499, 1390, 1095, 1618, 30, 220]])
    save_file({"tokens": ids}, os.path.join(work, "llama3-tokens.safetensors"))
    subprocess.run([hf_logits, out, os.path.join(work, "llama3-tokens.safetensors"),
                    os.path.join(work, "llama3-logits.safetensors")], check=True)
    mine = load_file(os.path.join(work, "llama3-logits.safetensors"))["logits"]
    with torch.no_grad():
        expected = reference(ids).logits
    worst = (mine - expected).abs().max().item()
    scale = expected.abs().max().item()
    ok = worst <= TOLERANCE * scale
    print(f"{'ok  ' if ok else 'FAIL'} weft's logits from the GGUF file within {worst:.3g} of transformers' from the HF "
          f"folder (largest {scale:.3g})")
    failures += 0 if ok else 1

    # 3. The tokenizer from the file's metadata.
    run = subprocess.run([tokenizer_encode, out, text_file], check=True, capture_output=True, text=True)
    got = json.loads(run.stdout)[0]
    with open(text_file, encoding="utf-8", errors="surrogateescape", newline="") as f:
        want = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)(f.read(), add_special_tokens=False)["input_ids"]
    ok = got == want
    print(f"{'ok  ' if ok else 'FAIL'} tokenizer from the GGUF metadata: {len(got)} ids, HF tokenizers' {len(want)}")
    failures += 0 if ok else 1
    # 4. Llama 3's chat template, from the tokenizer_config.json beside the tokenizer.json and from the
    # exported GGUF file's metadata: transformers' apply_chat_template's text and ids.
    from gguf_reference import check_chat_template
    reference_tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, bos_token="<|begin_of_text|>",
                                                  eos_token="<|eot_id|>")
    reference_tokenizer.chat_template = CHAT_TEMPLATE
    failures += check_chat_template(tokenizer_encode, tokenizer_json, reference_tokenizer, work)
    failures += check_chat_template(tokenizer_encode, out, reference_tokenizer, work)
    print("llama 3 gguf: all comparisons hold" if failures == 0 else f"llama 3 gguf: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
