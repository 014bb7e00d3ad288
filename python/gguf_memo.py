"""One parse of each GGUF file per process where transformers loads GGUF files: the transformers
baseline of `trainer bench --baseline pytorch` (pytorch_baseline.py) and the reference scripts in
tools/ that load the bundled model with transformers and PEFT.

transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`, AutoTokenizer's too) parses the
file's metadata with gguf-py at every call, twice per model (its config, then its weights), and
builds gguf-py's tensor-name map again for every module of the model. On the bundled SmolLM2 (a
49k-token vocabulary and its merges in the metadata) one parse takes ~8 s and the maps ~5 s per
model on a 2-core Xeon: more than half of a transformers load (23 s; 12 s with this), and a test
script loads the model up to three times.

`install()` makes `gguf.GGUFReader` return the reader already made for the same file (read-only
ones; a writable one is made anew) and memoizes `gguf.get_tensor_name_map` (a pure function of the
architecture and the layer count). transformers imports both from gguf when it loads, so it gets
these; the readers are read-only memory maps, so every value read is what a fresh parse gives. A
file is the same file while its path, inode, size and modification time are: a file written again
is parsed again.
"""
import functools
import os

import gguf


def install():
    if getattr(gguf, "_weft_memo_installed", False):
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    parse = gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        if mode != "r":  # a writable map is the caller's own
            return parse(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf._weft_memo_installed = True
