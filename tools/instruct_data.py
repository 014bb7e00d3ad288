"""Builds weft's bundled instruction set from the bundled Austen passages (the set-up runs it after
tools/classification_data.py; Python standard library only):

    python3 tools/instruct_data.py [AUSTEN_NOVEL_JSONL] [OUT_DIR]

austen-instruct: 400 chat conversations in TRL's "messages" form, each a system message, a question
about one passage of data/austen-novel/austen-novel.jsonl (200 to 420 characters, not opening with a
quotation mark, at least two sentences, drawn with a fixed seed) and the answer, two kinds alternating:
  - "Which of Jane Austen's novels is this passage from?" -> the novel's title ("Emma.");
  - "Quote the first sentence of this passage." -> its first sentence, verbatim.
Writes OUT_DIR (default data/austen-instruct)/austen-instruct.jsonl and a README beside it with the
counts and the file's SHA-256, and does nothing when that file already matches it; and questions.jsonl:
4 more conversations of the same kinds on passages the set does not hold (tools/instruct.sh asks them
before and after tuning)."""
import collections
import hashlib
import json
import os
import random
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = 400
SEED = 2026
SYSTEM = "You are a careful reader of Jane Austen's novels. Answer briefly."
TITLES = {"Sense & Sensibility": "Sense and Sensibility", "Pride & Prejudice": "Pride and Prejudice"}
# A sentence ends at . ! or ? (and any closing quotes) before a space and a capital or an opening quote.
SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019]*(?= [A-Z\"'\u201c\u2018])")


ABBREVIATIONS = ("Mr", "Mrs", "Dr", "St", "Col", "Capt", "Esq")


def first_sentence(passage):
    for match in SENTENCE_END.finditer(passage):
        if not passage[:match.start()].endswith(ABBREVIATIONS):  # "Mr. Darcy" goes on
            return passage[:match.end()]
    return None


def conversations(passages):
    out = []
    for k, (text, book) in enumerate(passages):
        if k % 2 == 0:
            question, answer = "Which of Jane Austen's novels is this passage from?", TITLES.get(book, book) + "."
        else:
            question, answer = "Quote the first sentence of this passage.", first_sentence(text)
        out.append({"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"{question}\n\n{text}"},
                                 {"role": "assistant", "content": answer}]})
    return out


def main():
    source = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "data/austen-novel/austen-novel.jsonl")
    out_dir = sys.argv[2] if len(sys.argv) > 2 else os.path.join(REPO, "data/austen-instruct")
    candidates = []
    with open(source, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            text = row["text"]
            sentence = first_sentence(text)
            if 200 <= len(text) <= 420 and not text.startswith(('"', "'")) and sentence and len(sentence) <= 160:
                candidates.append((text, row["label"]))
    random.Random(SEED).shuffle(candidates)
    rows = conversations(candidates[:EXAMPLES])
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "questions.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in conversations(candidates[EXAMPLES:EXAMPLES + 4]))
    digest = hashlib.sha256(body).hexdigest()
    path = os.path.join(out_dir, "austen-instruct.jsonl")
    if os.path.exists(path) and hashlib.sha256(open(path, "rb").read()).hexdigest() == digest:
        return
    with open(path, "wb") as f:
        f.write(body)
    novels = collections.Counter(r["messages"][2]["content"].rstrip(".") for k, r in enumerate(rows) if k % 2 == 0)
    with open(os.path.join(out_dir, "README"), "w", encoding="utf-8") as f:
        f.write(f"austen-instruct.jsonl: {len(rows)} chat conversations (TRL's \"messages\" form), built by "
                "tools/instruct_data.py\nfrom the passages of data/austen-novel/austen-novel.jsonl (200 to 420 "
                f"characters, not opening with a quotation mark, at least two sentences; seed {SEED}).\n\n"
                f"system: {SYSTEM}\n"
                f"{len(rows) - len(rows) // 2} x \"Which of Jane Austen's novels is this passage from?\" -> the title:\n")
        for title, n in sorted(novels.items()):
            f.write(f"  {title} {n}\n")
        f.write(f"{len(rows) // 2} x \"Quote the first sentence of this passage.\" -> its first sentence\n\n"
                f"sha256 austen-instruct.jsonl: {digest}\n")
    print(f"wrote {path}: {len(rows)} conversations")


if __name__ == "__main__":
    main()
