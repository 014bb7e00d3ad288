"""Builds weft's two bundled text-classification tasks from data that installs from Debian (the set-up
runs it after tools/fetch_austen.sh; Python standard library only):

    python3 tools/classification_data.py austen-novel [AUSTEN_JSONL] [OUT_DIR]
    python3 tools/classification_data.py fortunes [OUT_DIR]

austen-novel: which of Jane Austen's six novels a passage comes from. Every paragraph of at least
200 characters of data/austen/austen.jsonl (chapter headings and short lines of dialogue left out)
is one example: {"text": paragraph, "label": book}. Writes OUT_DIR (default data/austen-novel)
/austen-novel.jsonl.

fortunes: the topic of a quotation from Debian's `fortunes` and `fortunes-min` packages (fetched
with `apt-get download`, unpacked with dpkg-deb; nothing is installed): each quotation of a
category file of /usr/share/games/fortunes is one example {"text": quotation, "label": category},
categories with fewer than 50 quotations left out. Writes OUT_DIR (default data/fortunes)
/fortunes.jsonl.

Each writes a README beside its file with the counts per label and the file's SHA-256, and does
nothing when that file already matches it."""
import collections
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_PARAGRAPH = 200
MIN_CATEGORY = 50


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def complete(out_dir, name):
    readme, data = os.path.join(out_dir, "README"), os.path.join(out_dir, name)
    if not (os.path.exists(readme) and os.path.exists(data)):
        return False
    return f"sha256 {name}: {sha256(data)}" in open(readme, encoding="utf-8").read()


def write(out_dir, name, examples, source):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for text, label in examples:
            f.write(json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    counts = collections.Counter(label for _, label in examples)
    lines = [f"{name}: {len(examples)} examples in {len(counts)} classes, built by tools/classification_data.py",
             f"from {source}.", "", "examples per class:"]
    lines += [f"  {label}: {n}" for label, n in sorted(counts.items())]
    lines += ["", f"sha256 {name}: {sha256(path)}", ""]
    with open(os.path.join(out_dir, "README"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print(f"{path}: {len(examples)} examples, {len(counts)} classes (largest {max(counts.values())})")


def austen_novel(austen, out_dir):
    if complete(out_dir, "austen-novel.jsonl"):
        print(f"austen-novel: {out_dir} already complete; nothing to do")
        return
    examples = []
    with open(austen, encoding="utf-8") as f:
        for line in f:
            chapter = json.loads(line)
            for paragraph in re.split(r"\n\s*\n", chapter["text"]):
                text = " ".join(paragraph.split())
                if len(text) >= MIN_PARAGRAPH:
                    examples.append((text, chapter["book"]))
    write(out_dir, "austen-novel.jsonl", examples, f"the paragraphs of {os.path.relpath(austen, REPO)} "
          f"(at least {MIN_PARAGRAPH} characters), labeled with their novel")


def fortunes(out_dir):
    if complete(out_dir, "fortunes.jsonl"):
        print(f"fortunes: {out_dir} already complete; nothing to do")
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "fortunes", "fortunes-min"], cwd=tmp, check=True)
        versions = []
        for deb in sorted(glob.glob(os.path.join(tmp, "*.deb"))):
            subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "root")], check=True)
            versions.append(os.path.basename(deb).replace("%3a", ":"))
        directory = os.path.join(tmp, "root", "usr", "share", "games", "fortunes")
        examples = []
        for path in sorted(glob.glob(os.path.join(directory, "*"))):
            name = os.path.basename(path)
            if "." in name or os.path.islink(path):  # strfile's .dat indexes and the .u8 links
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                quotes = [q.strip() for q in re.split(r"^%$", f.read(), flags=re.M)]
            quotes = [re.sub(r".\x08", "", q) for q in quotes if q]  # overstriking (bold/underline)
            if len(quotes) >= MIN_CATEGORY:
                examples += [(q, name) for q in quotes]
    write(out_dir, "fortunes.jsonl", examples, "Debian's " + " and ".join(versions) +
          f" (/usr/share/games/fortunes; categories with at least {MIN_CATEGORY} quotations)")


def main(argv):
    if len(argv) >= 1 and argv[0] == "austen-novel":
        austen = argv[1] if len(argv) > 1 else os.path.join(REPO, "data", "austen", "austen.jsonl")
        austen_novel(austen, argv[2] if len(argv) > 2 else os.path.join(REPO, "data", "austen-novel"))
    elif len(argv) >= 1 and argv[0] == "fortunes":
        fortunes(argv[1] if len(argv) > 1 else os.path.join(REPO, "data", "fortunes"))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
