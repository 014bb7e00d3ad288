#!/usr/bin/env python3
"""weft's int8 and nf4 quantizers (core/model/quantize.cpp) against bitsandbytes' own (PyPI,
CPU backend): the same code books, the same stored bytes (int8: CB and SCB of
int8_vectorwise_quant; nf4: the packed nibbles, the double-quantized absmax, its second-level
scales and offset of quantize_4bit(blocksize=64, compress_statistics=True); weft's absmax codes
the nearer where bitsandbytes' CPU kernel takes a farther one) and the same dequantized
values, on matrices of Llama's shapes and awkward ones (a last block shorter than 64,
an odd element count), normal and heavy-tailed.

    quant_reference.py QUANTIZE_DUMP WORKDIR      (QUANTIZE_DUMP: the tool built with the tests)

Exits non-zero naming the first difference."""
import copy
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

import bitsandbytes.functional as F


def matrices():
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, (rows, cols) in {"square": (256, 256), "mlp_up": (1024, 256), "mlp_down": (256, 1024),
                               "tail_block": (100, 37), "odd_count": (33, 7)}.items():
        out[name + ".normal"] = torch.randn(rows, cols, generator=g) * 0.02
        heavy = torch.distributions.StudentT(2.0).sample((rows, cols)) * 0.01  # outliers (global seed)
        out[name + ".heavy"] = heavy
    return out


def check(what, ours, theirs, exact=True):
    ours, theirs = ours.flatten(), theirs.flatten()
    if ours.shape != theirs.shape:
        sys.exit(f"{what}: weft has {ours.numel()} values, bitsandbytes {theirs.numel()}")
    if exact:
        differ = (ours != theirs).nonzero().flatten()
        if differ.numel():
            i = differ[0].item()
            sys.exit(f"{what}: {differ.numel()} of {ours.numel()} values differ, first at {i}: weft {ours[i].item()} "
                     f"bitsandbytes {theirs[i].item()}")
    else:
        err = (ours.double() - theirs.double()).abs().max().item()
        if err > 1e-6 * max(theirs.abs().max().item(), 1e-30):
            sys.exit(f"{what}: differs by up to {err}")


def check_nearest_absmax_codes(name, w, ours, st):
    """The double-quantized block absmaxes: bitsandbytes' CPU kernel (an approximate binary search,
    then the nearer of two neighbours) picks a farther code for about 0.1% of values: within fp32
    noise of a midpoint, and near zero, where the code's steps are finer than its search. weft takes
    the nearest code; both must agree everywhere else (at most 1% may differ), and where they
    differ weft's code must be at least as near the value."""
    flat = w.reshape(-1).float()
    n, blocks = flat.numel(), -(-w.numel() // 64)
    absmax = torch.stack([flat[b * 64:(b + 1) * 64].abs().max() for b in range(blocks)])
    centered = absmax - ours[name + ".offset"][0]
    scales = ours[name + ".scale2"].repeat_interleave(256)[:blocks]
    normed = centered / scales
    code = F.create_dynamic_map(signed=True)
    a, b = ours[name + ".scale"].long(), st.absmax.long()
    differ = (a != b).nonzero().flatten()
    if differ.numel() > max(2, blocks // 100):
        sys.exit(f"nf4 {name}: quantized absmax: {differ.numel()} of {blocks} codes differ")
    for i in differ.tolist():
        da, db = (normed[i] - code[a[i]]).abs().item(), (normed[i] - code[b[i]]).abs().item()
        if da > db + 1e-6:
            sys.exit(f"nf4 {name}: absmax of block {i} ({normed[i].item()} of its scale): weft code {a[i].item()} "
                     f"({code[a[i]].item()}), bitsandbytes {b[i].item()} ({code[b[i]].item()})")
    return differ.numel(), blocks


def main():
    tool, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    torch.manual_seed(11)
    inputs = matrices()
    src = os.path.join(work, "matrices.safetensors")
    save_file(inputs, src)
    for fmt in ("int8", "nf4"):
        dst = os.path.join(work, f"{fmt}.safetensors")
        subprocess.run([tool, fmt, src, dst], check=True)
        ours = load_file(dst)
        codes_nearer = codes = 0
        if fmt == "nf4":
            check("nf4 code book", ours["nf4_code"], F.get_4bit_type("nf4", device="cpu"))
            check("dynamic 8-bit code book", ours["dynamic_code"], F.create_dynamic_map(signed=True))
        for name, w in inputs.items():
            if fmt == "int8":
                cb, scb, _ = F.int8_vectorwise_quant(w.clone())
                check(f"int8 {name}: data", ours[name + ".data"], cb)
                check(f"int8 {name}: scale", ours[name + ".scale"], scb)
                ref = cb.float() * scb.unsqueeze(1) / 127.0
            else:
                q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
                check(f"nf4 {name}: packed nibbles", ours[name + ".data"], q)
                check(f"nf4 {name}: absmax scales", ours[name + ".scale2"], st.state2.absmax)
                check(f"nf4 {name}: absmax offset", ours[name + ".offset"], st.offset.reshape(1))
                nearer, blocks = check_nearest_absmax_codes(name, w, ours, st)
                codes_nearer += nearer
                codes += blocks
                # Decoding: bitsandbytes' dequantize_4bit on the bytes weft stored.
                mine = copy.deepcopy(st)
                mine.absmax, mine.state2.absmax, mine.offset = ours[name + ".scale"], ours[name + ".scale2"], ours[name + ".offset"][0]
                ref = F.dequantize_4bit(ours[name + ".data"].reshape(q.shape), mine)
            check(f"{fmt} {name}: dequantized", ours[name + ".dequantized"], ref, exact=False)
        version = getattr(__import__("bitsandbytes"), "__version__", "?")
        if fmt == "int8":
            print(f"int8: {len(inputs)} matrices: data, scales and dequantized values equal bitsandbytes {version}")
        else:
            print(f"nf4: {len(inputs)} matrices: code books, packed nibbles, absmax scales and offsets equal bitsandbytes "
                  f"{version}; {codes - codes_nearer} of {codes} absmax codes equal, the other {codes_nearer} nearer "
                  f"the value than its CPU kernel's; dequantization equals its dequantize_4bit")


if __name__ == "__main__":
    main()
