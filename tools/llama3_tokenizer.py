#!/usr/bin/env python3
"""Llama 3's real tokenizer as an HF tokenizer.json, and a three-way check of weft's BPE encoder.

The vocabulary comes from Meta's PyPI package `llama-models` (llama_models/llama3/tokenizer.model,
tiktoken's format: base64 bytes and rank per line; the Llama 3 Community License), the reference
encoders from PyPI too: Meta's own (`tiktoken`, the encoder llama-models wraps) and Hugging
Face's `tokenizers`, the library transformers uses. tools/setup.sh installs all three into the
project's virtual environment; ctest runs `check` on the whole bundled corpus.

  llama3_tokenizer.py build OUT_JSON
      writes the HF-format tokenizer.json (byte-level BPE, Llama 3's split regex, 128000 ranked
      tokens, merges recovered from the ranks as transformers' TikTokenConverter does, the 256
      special tokens, BOS from a TemplateProcessing post-processor).
  llama3_tokenizer.py check OUT_JSON WEFT_ENCODER FILE...
      builds OUT_JSON, then encodes each FILE (its whole text, no BOS/EOS) with tiktoken, with
      HF tokenizers loading OUT_JSON, and with weft (WEFT_ENCODER: the tokenizer_encode tool,
      which prints weft's ids as JSON). Exits 1 on the first file where any two differ in any id.
"""
import base64
import importlib.resources
import json
import subprocess
import sys

SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def die(message):
    print(f"llama3_tokenizer: error: {message}", file=sys.stderr)
    sys.exit(1)


def meta_tokenizer():
    """Meta's reference tokenizer (llama_models.llama3.tokenizer.Tokenizer, over tiktoken)."""
    try:
        from llama_models.llama3.tokenizer import Tokenizer
    except ImportError as e:
        die(f"{e}: install llama-models and tiktoken (tools/setup.sh puts them in the venv)")
    return Tokenizer.get_instance()


def load_ranks():
    path = importlib.resources.files("llama_models.llama3") / "tokenizer.model"
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def build_tokenizer_json(meta):
    ranks = load_ranks()
    byte_char = bytes_to_unicode()

    def text(token):
        return "".join(byte_char[b] for b in token)

    # A token of rank r was made by merging two shorter tokens that exist; every such split is a
    # merge of priority r (ties ordered by the parts' ranks), as transformers' TikTokenConverter.
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda s: (ranks[s[0]], ranks[s[1]]))
        merges.extend((rank, a, b) for a, b in splits)
    merges.sort(key=lambda m: m[0])
    first_special = len(ranks)
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for name, i in sorted(meta.special_tokens.items(), key=lambda item: item[1])]
    if added[0]["id"] != first_special or added[0]["content"] != "<|begin_of_text|>":
        die(f"unexpected special tokens: {added[:2]} (after {first_special} ranked tokens)")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    bos = "<|begin_of_text|>"
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": {"type": "Sequence", "processors": [
            {**byte_level, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [first_special], "tokens": [bos]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(token): rank for token, rank in ranks.items()},
                  "merges": [[text(a), text(b)] for _, a, b in merges]},
    }


def first_difference(a, b):
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return None if k == len(a) == len(b) else k


def check(out_json, weft_encoder, files):
    try:
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError as e:
        die(f"{e}: install tokenizers (tools/setup.sh puts it in the venv)")
    meta = meta_tokenizer()
    hf = HfTokenizer.from_file(out_json)
    weft = subprocess.run([weft_encoder, out_json, *files], stdout=subprocess.PIPE, check=False)
    if weft.returncode != 0:
        die(f"{weft_encoder} exited with {weft.returncode}")
    weft_ids = json.loads(weft.stdout)
    failures = 0
    for name, ours in zip(files, weft_ids):
        with open(name, encoding="utf-8", newline="") as f:  # the bytes weft reads: keep "\r\n"
            content = f.read()
        # Special-token text (e.g. "<|eot_id|>") encodes to its special id, as in HF tokenizers.
        encoders = {"tiktoken (Meta)": meta.model.encode(content, allowed_special="all"),
                    "HF tokenizers": hf.encode(content, add_special_tokens=False).ids,
                    "weft": ours}
        reference = encoders["HF tokenizers"]
        bad = [(who, ids) for who, ids in encoders.items() if first_difference(reference, ids) is not None]
        if not bad:
            print(f"same   {name}: {len(reference)} tokens from {len(content)} characters, "
                  f"identical from {', '.join(encoders)}")
            continue
        failures += 1
        for who, ids in bad:
            k = first_difference(reference, ids)
            print(f"DIFFER {name}: {who} first differs from HF tokenizers at token {k}: "
                  f"{ids[k:k + 8]} vs {reference[k:k + 8]} ({len(ids)} vs {len(reference)} tokens)")
    return 1 if failures else 0


def main(argv):
    if not ((argv[:1] == ["build"] and len(argv) == 2) or (argv[:1] == ["check"] and len(argv) >= 4)):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(build_tokenizer_json(meta_tokenizer()), f, ensure_ascii=False)
    print(f"wrote {argv[1]}", file=sys.stderr)
    return check(argv[1], argv[2], argv[3:]) if argv[0] == "check" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
