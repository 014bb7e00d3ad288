#!/usr/bin/python3
"""Convert Jane Austen's six novels from an R lazy-load database to JSONL.

The Debian package r-cran-janeaustenr stores the novels as R character vectors
in a lazy-load database (<prefix>.rdx index + <prefix>.rdb blocks). This script
reads that database without R: it parses the index and the blocks, decodes R's
XDR serialization format (versions 2 and 3), splits each novel into chapters
and writes

    <out>/austen.jsonl   one {"text", "book", "chapter"} object per chapter
    <out>/README         source package, counts and the SHA-256 of austen.jsonl

Both files are written to temporary names and renamed into place, README last,
so a README that exists describes a complete austen.jsonl.

Usage:
    austen_to_jsonl.py --db PREFIX [--db PREFIX ...] --out DIR [--source TEXT]
    austen_to_jsonl.py --self-test

PREFIX is a path without the .rdx/.rdb extension; when several are given, the
first one whose index holds all six novels is used. Standard library only.
"""

import argparse
import bz2
import gzip
import hashlib
import io
import json
import os
import re
import struct
import sys
import tempfile
import zlib

try:
    import lzma
except ImportError:  # Python built without liblzma: only xz-compressed input fails.
    lzma = None


class RFormatError(Exception):
    """Input is not a lazy-load database / R serialization this script understands."""


# ---------------------------------------------------------------------------
# R objects
# ---------------------------------------------------------------------------

# SEXP type codes (R's Rinternals.h) and serialization pseudo-types (serialize.c).
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
SPECIALSXP, BUILTINSXP, CHARSXP, LGLSXP = 7, 8, 9, 10
INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 13, 14, 15, 16, 17
VECSXP, EXPRSXP, BCODESXP, EXTPTRSXP, WEAKREFSXP, RAWSXP, S4SXP = 19, 20, 21, 22, 23, 24, 25
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP = 255, 254, 253, 252
MISSINGARG_SXP, BASENAMESPACE_SXP, NAMESPACESXP, PACKAGESXP = 251, 250, 249, 248
PERSISTSXP, CLASSREFSXP, GENERICREFSXP, BCREPDEF, BCREPREF = 247, 246, 245, 244, 243
EMPTYENV_SXP, BASEENV_SXP, ATTRLANGSXP, ATTRLISTSXP, ALTREP_SXP = 242, 241, 240, 239, 238

NA_INTEGER = -2147483648
# CHARSXP "levels" encoding bits.
LATIN1_MASK, UTF8_MASK, BYTES_MASK, ASCII_MASK = 1 << 2, 1 << 3, 1 << 1, 1 << 6


class RObject:
    """A decoded R value: its SEXP type, a Python payload and its attributes.

    Payloads: vectors -> list (NA -> None); CHARSXP -> str or None; SYMSXP ->
    str (the name); pairlists -> list of (tag or None, value); environments and
    other reference objects -> a descriptive dict.
    """

    __slots__ = ("type", "value", "attrs")

    def __init__(self, sexptype, value=None, attrs=None):
        self.type = sexptype
        self.value = value
        self.attrs = attrs if attrs is not None else {}

    def __repr__(self):
        return "RObject(type=%d, value=%r, attrs=%r)" % (self.type, self.value, self.attrs)

    def attr(self, name):
        return self.attrs.get(name)

    def names(self):
        names = self.attrs.get("names")
        return names.value if names is not None else None

    def as_dict(self):
        """A named list or vector as {name: element}; fails if it has no names."""
        names = self.names()
        if names is None or len(names) != len(self.value):
            raise RFormatError("R object of type %d has no usable names attribute" % self.type)
        return dict(zip(names, self.value))


R_NIL = RObject(NILSXP)


class RUnserializer:
    """Decodes one R serialization stream ("X\\n" XDR, format version 2 or 3)."""

    def __init__(self, data, where="<bytes>"):
        self.data = data
        self.pos = 0
        self.where = where
        self.refs = []
        self.native_encoding = "UTF-8"

    # -- primitives ---------------------------------------------------------

    def _take(self, n):
        if n < 0 or self.pos + n > len(self.data):
            raise RFormatError("%s: truncated R serialization at byte %d (wanted %d more)"
                               % (self.where, self.pos, n))
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def _int(self):
        return struct.unpack(">i", self._take(4))[0]

    def _length(self):
        n = self._int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            upper, lower = struct.unpack(">II", self._take(8))
            n = (upper << 32) | lower
        if n < 0:
            raise RFormatError("%s: negative vector length %d at byte %d" % (self.where, n, self.pos))
        return n

    # -- entry point --------------------------------------------------------

    def read(self):
        """Parses the header and the single top-level object; returns it."""
        fmt = self._take(2)
        if fmt != b"X\n":
            names = {b"A\n": "ASCII", b"B\n": "native binary"}
            raise RFormatError("%s: unsupported R serialization format %r (%s); only XDR ('X\\n') is handled"
                               % (self.where, fmt, names.get(fmt, "unknown")))
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader R version
        if version == 3:
            self.native_encoding = self._take(self._int()).decode("ascii", "replace")
        elif version != 2:
            raise RFormatError("%s: unsupported R serialization version %d (need 2 or 3)"
                               % (self.where, version))
        return self._item()

    # -- items --------------------------------------------------------------

    def _item(self):
        flags = self._int()
        sexptype = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        simple = {NILVALUE_SXP: R_NIL, EMPTYENV_SXP: RObject(ENVSXP, {"env": "empty"}),
                  BASEENV_SXP: RObject(ENVSXP, {"env": "base"}),
                  GLOBALENV_SXP: RObject(ENVSXP, {"env": "global"}),
                  UNBOUNDVALUE_SXP: RObject(SYMSXP, "<unbound>"),
                  MISSINGARG_SXP: RObject(SYMSXP, ""),
                  BASENAMESPACE_SXP: RObject(ENVSXP, {"namespace": "base"})}
        if sexptype in simple:
            return simple[sexptype]
        if sexptype == REFSXP:
            index = flags >> 8
            if index == 0:
                index = self._int()
            if not 1 <= index <= len(self.refs):
                raise RFormatError("%s: reference #%d out of range (%d known) at byte %d"
                                   % (self.where, index, len(self.refs), self.pos))
            return self.refs[index - 1]
        if sexptype in (PERSISTSXP, PACKAGESXP, NAMESPACESXP):
            obj = RObject(sexptype, {"kind": {PERSISTSXP: "persist", PACKAGESXP: "package",
                                              NAMESPACESXP: "namespace"}[sexptype],
                                     "name": self._string_vector()})
            self.refs.append(obj)
            return obj
        if sexptype == SYMSXP:
            obj = RObject(SYMSXP, self._item().value)
            self.refs.append(obj)
            return obj
        if sexptype == ENVSXP:
            return self._environment()
        if sexptype in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP):
            return self._pairlist(sexptype, has_attr, has_tag)
        if sexptype == ALTREP_SXP:
            return self._altrep()
        if sexptype == CHARSXP:
            return RObject(CHARSXP, self._charsxp(levels))

        obj = self._vector(sexptype, flags)
        if has_attr:
            obj.attrs = self._attributes(self._item())
        return obj

    def _vector(self, sexptype, flags):
        if sexptype in (LGLSXP, INTSXP):
            n = self._length()
            values = struct.unpack(">%di" % n, self._take(4 * n))
            return RObject(sexptype, [None if v == NA_INTEGER else v for v in values])
        if sexptype == REALSXP:
            n = self._length()
            return RObject(sexptype, list(struct.unpack(">%dd" % n, self._take(8 * n))))
        if sexptype == CPLXSXP:
            n = self._length()
            parts = struct.unpack(">%dd" % (2 * n), self._take(16 * n))
            return RObject(sexptype, [complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)])
        if sexptype == RAWSXP:
            return RObject(sexptype, self._take(self._length()))
        if sexptype == STRSXP:
            n = self._length()
            values = []
            for _ in range(n):
                element = self._item()
                if element.type != CHARSXP:
                    raise RFormatError("%s: character vector element of type %d (expected CHARSXP) at byte %d"
                                       % (self.where, element.type, self.pos))
                values.append(element.value)
            return RObject(sexptype, values)
        if sexptype in (VECSXP, EXPRSXP):
            n = self._length()
            return RObject(sexptype, [self._item() for _ in range(n)])
        if sexptype in (SPECIALSXP, BUILTINSXP):
            return RObject(sexptype, self._take(self._int()).decode("latin-1"))
        if sexptype == S4SXP:
            return RObject(sexptype, None)
        if sexptype == EXTPTRSXP:
            obj = RObject(sexptype, None)
            self.refs.append(obj)
            obj.value = {"prot": self._item(), "tag": self._item()}
            return obj
        if sexptype == WEAKREFSXP:
            obj = RObject(sexptype, None)
            self.refs.append(obj)
            return obj
        raise RFormatError("%s: unsupported SEXP type %d (flags 0x%08x) at byte %d"
                           % (self.where, sexptype, flags & 0xFFFFFFFF, self.pos - 4))

    def _charsxp(self, levels):
        n = self._int()
        if n == -1:
            return None  # NA_character_
        raw = self._take(n)
        if levels & UTF8_MASK or levels & ASCII_MASK:
            return raw.decode("utf-8")
        if levels & LATIN1_MASK:
            return raw.decode("latin-1")
        if levels & BYTES_MASK:
            return raw.decode("latin-1")  # uninterpreted bytes: keep them 1:1
        try:  # native encoding of the writer (only recorded in version 3)
            return raw.decode(self.native_encoding)
        except (LookupError, UnicodeDecodeError):
            return raw.decode("utf-8", "replace")

    def _string_vector(self):
        """InStringVec: used by PERSISTSXP/PACKAGESXP/NAMESPACESXP."""
        if self._int() != 0:
            raise RFormatError("%s: names in persistent string vectors are not supported" % self.where)
        return [self._item().value for _ in range(self._length())]

    def _environment(self):
        obj = RObject(ENVSXP, {})
        self.refs.append(obj)  # registered before its contents, which may refer to it
        locked = self._int()
        enclos, frame, hashtab, attrib = self._item(), self._item(), self._item(), self._item()
        obj.value = {"locked": bool(locked), "enclos": enclos, "frame": frame, "hashtab": hashtab}
        obj.attrs = self._attributes(attrib)
        return obj

    def _pairlist(self, sexptype, has_attr, has_tag):
        """Reads a pairlist-like cell; LISTSXP/LANGSXP CDR chains are read iteratively.

        CLOSXP and PROMSXP cells are returned as a single (tag, car) cell plus
        the CDR (body or expression) as a second cell.
        """
        chain_types = (LISTSXP, LANGSXP, ATTRLISTSXP, ATTRLANGSXP, DOTSXP)
        cells = []
        attrs = None
        while True:
            attrib = self._item() if has_attr else R_NIL
            tag = self._item() if has_tag else None
            if attrs is None:
                attrs = attrib
            car = self._item()
            cells.append((tag.value if tag is not None and tag.type == SYMSXP else None, car))
            flags = self._int()
            next_type = flags & 0xFF
            if next_type == NILVALUE_SXP:
                break
            if sexptype not in chain_types or next_type not in chain_types:
                self.pos -= 4
                cells.append((None, self._item()))  # CDR that is not a list cell
                break
            has_attr = bool(flags & (1 << 9))
            has_tag = bool(flags & (1 << 10))
        obj = RObject(sexptype, cells)
        obj.attrs = self._attributes(attrs)
        return obj

    def _attributes(self, pairlist):
        if pairlist is None or pairlist.type == NILSXP:
            return {}
        if pairlist.type not in (LISTSXP, ATTRLISTSXP):
            raise RFormatError("%s: attributes are of type %d, expected a pairlist" % (self.where, pairlist.type))
        return {tag: value for tag, value in pairlist.value}

    def _altrep(self):
        info = self._item()
        state = self._item()
        attrib = self._item()
        if info.type != LISTSXP or not info.value or info.value[0][1].type != SYMSXP:
            raise RFormatError("%s: malformed ALTREP class information" % self.where)
        class_name = info.value[0][1].value
        obj = self._expand_altrep(class_name, state)
        obj.attrs = self._attributes(attrib)
        return obj

    def _expand_altrep(self, class_name, state):
        """Materialises the ALTREP classes base R serializes in compact form."""
        if class_name in ("compact_intseq", "compact_realseq"):
            if state.type != REALSXP or len(state.value) != 3:
                raise RFormatError("%s: malformed %s state" % (self.where, class_name))
            n, start, step = state.value
            values = [start + i * step for i in range(int(n))]
            if class_name == "compact_intseq":
                return RObject(INTSXP, [int(v) for v in values])
            return RObject(REALSXP, [float(v) for v in values])
        if class_name.startswith("wrap_"):
            # state is CONS(wrapped vector, metadata)
            if state.type != LISTSXP or not state.value:
                raise RFormatError("%s: malformed %s state" % (self.where, class_name))
            wrapped = state.value[0][1]
            return RObject(wrapped.type, wrapped.value, dict(wrapped.attrs))
        if class_name == "deferred_string":
            # state is CONS(original numeric vector, scalar-print info)
            if state.type != LISTSXP or not state.value:
                raise RFormatError("%s: malformed deferred_string state" % self.where)
            original = state.value[0][1]
            return RObject(STRSXP, [None if v is None else _r_number_to_string(v) for v in original.value])
        raise RFormatError("%s: unsupported ALTREP class '%s'" % (self.where, class_name))


def _r_number_to_string(value):
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def unserialize(data, where="<bytes>"):
    """Decodes one R serialization stream (XDR, version 2 or 3) into an RObject."""
    return RUnserializer(data, where).read()


# ---------------------------------------------------------------------------
# Lazy-load database
# ---------------------------------------------------------------------------

def decompress_file_bytes(raw, where):
    """Undoes the whole-file compression saveRDS may apply (gzip, bzip2, xz, none)."""
    if raw[:2] == b"\x1f\x8b":
        return gzip.decompress(raw)
    if raw[:3] == b"BZh":
        return bz2.decompress(raw)
    if raw[:6] == b"\xfd7zXZ\x00":
        if lzma is None:
            raise RFormatError("%s: xz-compressed but this Python has no lzma module" % where)
        return lzma.decompress(raw)
    if raw[:2] in (b"X\n", b"A\n", b"B\n"):
        return raw
    raise RFormatError("%s: not an R serialized file (starts with %r)" % (where, raw[:6]))


def read_index(rdx_path):
    """Reads <prefix>.rdx: returns ({variable: (offset, length)}, compression)."""
    with open(rdx_path, "rb") as handle:
        raw = handle.read()
    index = unserialize(decompress_file_bytes(raw, rdx_path), rdx_path).as_dict()
    if "variables" not in index:
        raise RFormatError("%s: lazy-load index has no 'variables' entry" % rdx_path)
    variables = {}
    for name, pair in index["variables"].as_dict().items():
        if pair.type not in (INTSXP, REALSXP) or len(pair.value) != 2:
            raise RFormatError("%s: variable '%s' has no (offset, length) pair" % (rdx_path, name))
        variables[name] = (int(pair.value[0]), int(pair.value[1]))
    compressed = index.get("compressed")
    compression = 1 if compressed is None else int(compressed.value[0])
    return variables, compression


def decompress_block(block, compression, where):
    """Decodes one .rdb block as R's lazyLoadDBfetch does (R_decompress1/2/3)."""
    if len(block) < 4:
        raise RFormatError("%s: block shorter than its 4-byte length header" % where)
    expected = struct.unpack(">I", block[:4])[0]
    if compression == 0:
        return block
    if compression == 1:  # R_decompress1: length + zlib stream
        kind, payload = b"1", block[4:]
    elif compression in (2, 3):  # R_decompress2/3: length + type byte + payload
        kind, payload = block[4:5], block[5:]
    else:
        raise RFormatError("%s: unknown lazy-load compression %d" % (where, compression))
    if kind == b"0":
        data = payload
    elif kind == b"1":
        data = zlib.decompress(payload)
    elif kind == b"2":
        data = bz2.decompress(payload)
    elif kind == b"Z" and compression == 3:
        if lzma is None:
            raise RFormatError("%s: xz-compressed block but this Python has no lzma module" % where)
        data = lzma.decompress(payload)
    else:
        raise RFormatError("%s: unknown block compression type %r (compression=%d)"
                           % (where, kind, compression))
    if len(data) != expected:
        raise RFormatError("%s: block decompressed to %d bytes, header says %d"
                           % (where, len(data), expected))
    return data


class LazyLoadDB:
    """An R lazy-load database <prefix>.rdx/<prefix>.rdb opened for reading."""

    def __init__(self, prefix):
        self.prefix = prefix
        self.variables, self.compression = read_index(prefix + ".rdx")

    def load(self, name):
        """Returns variable `name` as an RObject; raises KeyError if absent."""
        offset, length = self.variables[name]
        with open(self.prefix + ".rdb", "rb") as handle:
            handle.seek(offset)
            block = handle.read(length)
        where = "%s.rdb[%s]" % (self.prefix, name)
        if len(block) != length:
            raise RFormatError("%s: truncated block (%d of %d bytes)" % (where, len(block), length))
        return unserialize(decompress_block(block, self.compression, where), where)


# ---------------------------------------------------------------------------
# Novels -> chapters
# ---------------------------------------------------------------------------

# Variable name in janeaustenr -> title as janeaustenr's austen_books() labels it.
# Order: publication order, as austen_books() uses.
NOVELS = [
    ("sensesensibility", "Sense & Sensibility"),
    ("prideprejudice", "Pride & Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
]

CHAPTER_RE = re.compile(r"^\s*(CHAPTER|Chapter)\b")
VOLUME_RE = re.compile(r"^\s*VOLUME\s+[IVXLC\d]+\.?\s*$", re.IGNORECASE)
# First line of the matter that follows the last chapter: "THE END", "FINIS",
# or the publisher's editorial note appended to Northanger Abbey.
BACK_MATTER_RE = re.compile(r"^\s*(THE END|FINIS|A NOTE ON THE TEXT)\.?\s*$", re.IGNORECASE)


def _is_volume_heading(lines, index):
    """True if lines[index] is "VOLUME n" and the next non-blank line is a chapter heading."""
    if not VOLUME_RE.match(lines[index]):
        return False
    for line in lines[index + 1:]:
        if line.strip():
            return bool(CHAPTER_RE.match(line))
    return False


def split_chapters(lines):
    """Splits a novel's lines into chapters (lists of lines).

    A chapter starts at a line beginning with CHAPTER/Chapter and includes that
    heading. Front matter before the first heading is attached to the first
    chapter. Volume headings ("VOLUME II") directly before a chapter heading are
    dropped, as is everything from a "THE END"/"FINIS"/"A NOTE ON THE TEXT"
    line after the last chapter heading; trailing blank lines are trimmed.
    Raises ValueError if there is no chapter heading.
    """
    lines = ["" if line is None else line for line in lines]
    starts = [i for i, line in enumerate(lines) if CHAPTER_RE.match(line)]
    if not starts:
        raise ValueError("no chapter headings found")
    end = next((i for i in range(starts[-1], len(lines)) if BACK_MATTER_RE.match(lines[i])), len(lines))
    keep = [i for i in range(end) if not _is_volume_heading(lines, i)]
    lines = [lines[i] for i in keep]
    starts = [i for i, line in enumerate(lines) if CHAPTER_RE.match(line)]
    bounds = [0] + starts[1:] + [len(lines)]
    chapters = []
    for begin, stop in zip(bounds, bounds[1:]):
        body = lines[begin:stop]
        while body and not body[-1].strip():
            body.pop()
        chapters.append(body)
    return chapters


def paragraphs(lines):
    """Joins lines into paragraphs: blank lines separate, inner lines joined by a space."""
    result, current = [], []
    for line in lines:
        text = line.strip()
        if text:
            current.append(text)
        elif current:
            result.append(" ".join(current))
            current = []
    if current:
        result.append(" ".join(current))
    return "\n\n".join(result)


def novel_records(db):
    """Yields {"text", "book", "chapter"} dicts for every chapter of every novel."""
    for variable, title in NOVELS:
        novel = db.load(variable)
        if novel.type != STRSXP:
            raise RFormatError("%s: '%s' is of SEXP type %d, expected a character vector"
                               % (db.prefix, variable, novel.type))
        try:
            chapters = split_chapters(novel.value)
        except ValueError as error:
            raise RFormatError("%s: '%s': %s" % (db.prefix, variable, error))
        for number, chapter_lines in enumerate(chapters, start=1):
            yield {"text": paragraphs(chapter_lines), "book": title, "chapter": number}


def open_novel_db(prefixes):
    """Returns the first LazyLoadDB among `prefixes` whose index holds all six novels."""
    wanted = {variable for variable, _ in NOVELS}
    problems = []
    for prefix in prefixes:
        try:
            db = LazyLoadDB(prefix)
        except (OSError, RFormatError, zlib.error) as error:
            problems.append("%s: %s" % (prefix, error))
            continue
        missing = wanted - set(db.variables)
        if not missing:
            return db
        problems.append("%s: lacks %s" % (prefix, ", ".join(sorted(missing))))
    raise RFormatError("no lazy-load database holds the six novels (" + "; ".join(problems) + ")")


def _atomic_write(path, data):
    directory = os.path.dirname(path) or "."
    fd, temp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # mkstemp creates 0600; use the usual mode
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def convert(prefixes, out_dir, source):
    """Writes <out_dir>/austen.jsonl and <out_dir>/README; returns the summary counts."""
    db = open_novel_db(prefixes)
    records = list(novel_records(db))
    jsonl = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    per_book = {}
    for r in records:
        stats = per_book.setdefault(r["book"], [0, 0, 0])
        stats[0] += 1
        stats[1] += len(r["text"].split())
        stats[2] += len(r["text"])
    counts = {"books": len(per_book), "chapters": len(records),
              "words": sum(s[1] for s in per_book.values()),
              "characters": sum(s[2] for s in per_book.values())}
    readme = [
        "Jane Austen's six novels, one JSON object per chapter (public domain texts).",
        "Made by tools/fetch_austen.sh + tools/austen_to_jsonl.py from the R lazy-load database in",
        "source: %s" % source,
        "database: %s.rdb/.rdx" % "/".join(os.path.abspath(db.prefix).split(os.sep)[-3:]),
        "",
        "format: austen.jsonl, UTF-8; fields: text (paragraphs separated by a blank line),",
        "        book (title), chapter (1-based within the book; front matter is in chapter 1)",
        "words = whitespace-separated tokens; characters = Unicode code points of text",
        "",
        "books: %d" % counts["books"],
        "chapters: %d" % counts["chapters"],
        "words: %d" % counts["words"],
        "characters: %d" % counts["characters"],
    ]
    for book, (chapters, words, characters) in per_book.items():
        readme.append("  %-20s chapters %3d  words %7d  characters %8d" % (book, chapters, words, characters))
    readme.append("sha256 austen.jsonl: %s" % hashlib.sha256(jsonl).hexdigest())
    os.makedirs(out_dir, exist_ok=True)
    _atomic_write(os.path.join(out_dir, "austen.jsonl"), jsonl)
    _atomic_write(os.path.join(out_dir, "README"), ("\n".join(readme) + "\n").encode("utf-8"))
    return counts


# ---------------------------------------------------------------------------
# Self-test: hand-built serialized objects, no network and no R needed
# ---------------------------------------------------------------------------

class _Writer:
    """Minimal XDR R serializer used only by the self-test."""

    def __init__(self, version=3):
        self.out = io.BytesIO()
        self.out.write(b"X\n")
        self.i(version)
        self.i(0x040201)  # written by R 4.2.1
        self.i(0x030500)  # readable by R >= 3.5.0
        if version == 3:
            self.i(5)
            self.out.write(b"UTF-8")

    def i(self, value):
        self.out.write(struct.pack(">i", value))
        return self

    def flags(self, sexptype, levels=0, attr=False, tag=False):
        return self.i(sexptype | (levels << 12) | (attr << 9) | (tag << 10))

    def char(self, text, levels=UTF8_MASK):
        if text is None:
            return self.flags(CHARSXP).i(-1)
        raw = text.encode("utf-8" if levels & UTF8_MASK else "latin-1")
        self.flags(CHARSXP, levels).i(len(raw))
        self.out.write(raw)
        return self

    def nil(self):
        return self.i(NILVALUE_SXP)

    def strs(self, values, attr=False):
        self.flags(STRSXP, attr=attr).i(len(values))
        for v in values:
            self.char(v, ASCII_MASK if v is not None and v.isascii() else UTF8_MASK)
        return self

    def ints(self, values, attr=False):
        self.flags(INTSXP, attr=attr).i(len(values))
        for v in values:
            self.i(NA_INTEGER if v is None else v)
        return self

    def reals(self, values):
        self.flags(REALSXP).i(len(values))
        self.out.write(struct.pack(">%dd" % len(values), *values))
        return self

    def sym(self, name):
        return self.flags(SYMSXP).char(name, ASCII_MASK)

    def ref(self, index):
        return self.i(REFSXP | (index << 8))

    def bytes(self):
        return self.out.getvalue()


def _expect(condition, message):
    if not condition:
        raise AssertionError("self-test: " + message)


def _expect_error(function, fragment):
    try:
        function()
    except RFormatError as error:
        _expect(fragment in str(error), "error %r lacks %r" % (str(error), fragment))
        return
    raise AssertionError("self-test: expected an RFormatError mentioning %r" % fragment)


def _self_test_unserialize():
    # list(a = c("x", NA, "é"), b = 1:3 (compact ALTREP), c = c(7L, NA)), with a
    # names attribute; the symbol 'names' is written once, then as a reference.
    w = _Writer()
    w.flags(VECSXP, attr=True).i(3)
    w.strs(["x", None, "é"])
    w.flags(ALTREP_SXP)
    w.flags(LISTSXP).sym("compact_intseq").flags(LISTSXP).sym("base").flags(LISTSXP).ints([13]).nil()
    w.reals([3.0, 1.0, 1.0])
    w.nil()
    w.ints([7, None])
    w.flags(LISTSXP, attr=False, tag=True).sym("names").strs(["a", "b", "c"]).nil()
    obj = unserialize(w.bytes())
    _expect(obj.type == VECSXP and len(obj.value) == 3, "top-level list of 3")
    d = obj.as_dict()
    _expect(d["a"].value == ["x", None, "é"], "strings with NA and UTF-8: %r" % d["a"].value)
    _expect(d["b"].type == INTSXP and d["b"].value == [1, 2, 3], "compact_intseq 1:3: %r" % d["b"].value)
    _expect(d["c"].value == [7, None], "integers with NA")

    # Version 2, REFSXP to an earlier symbol, a latin-1 string and a data frame
    # whose row.names are the compact c(NA, -2) form.
    w = _Writer(version=2)
    w.flags(VECSXP, attr=True).i(1)
    w.strs(["caf\u00e9", "b"])
    w.flags(LISTSXP, tag=True).sym("names").strs(["text"])
    w.flags(LISTSXP, tag=True).sym("class").strs(["data.frame"])
    w.flags(LISTSXP, tag=True).sym("row.names").ints([None, -2])
    w.nil()
    frame = unserialize(w.bytes())
    _expect(frame.attr("class").value == ["data.frame"], "data.frame class")
    _expect(frame.as_dict()["text"].value == ["caf\u00e9", "b"], "data.frame column")
    _expect(frame.attr("row.names").value == [None, -2], "compact row.names")

    w = _Writer()
    w.flags(LISTSXP, tag=True).sym("k").strs(["v1"])
    w.flags(LISTSXP, tag=True).ref(1).strs(["v2"]).nil()
    pairs = unserialize(w.bytes())
    _expect(pairs.value[0][0] == "k" and pairs.value[1][0] == "k", "REFSXP resolves to symbol 'k'")
    latin = _Writer()
    latin.flags(STRSXP).i(1).char("\u00e9t\u00e9", LATIN1_MASK)
    _expect(unserialize(latin.bytes()).value == ["\u00e9t\u00e9"], "latin-1 CHARSXP")

    # Malformed inputs fail with a clear message.
    _expect_error(lambda: unserialize(_Writer().flags(BCODESXP).bytes()), "unsupported SEXP type 21")
    _expect_error(lambda: unserialize(b"A\n1\n"), "unsupported R serialization format")
    _expect_error(lambda: unserialize(_Writer().strs(["abc"]).bytes()[:-2]), "truncated")
    _expect_error(lambda: unserialize(_Writer().ref(5).bytes()), "reference #5 out of range")
    bad_altrep = _Writer().flags(ALTREP_SXP).flags(LISTSXP).sym("mmap_real").nil().nil().nil()
    _expect_error(lambda: unserialize(bad_altrep.bytes()), "unsupported ALTREP class 'mmap_real'")
    _expect_error(lambda: decompress_block(b"\x00\x00\x00\x01Q?", 3, "blk"), "unknown block compression type")


def _write_fake_db(prefix, novels, compression=1):
    """Writes a lazy-load DB holding character vectors, as makeLazyLoadDB does."""
    blocks, offsets = [], {}
    position = 0
    for name, lines in novels.items():
        payload = _Writer().strs(lines).bytes()
        if compression == 1:
            block = struct.pack(">I", len(payload)) + zlib.compress(payload)
        else:
            block = struct.pack(">I", len(payload)) + b"2" + bz2.compress(payload)
        offsets[name] = (position, len(block))
        position += len(block)
        blocks.append(block)
    with open(prefix + ".rdb", "wb") as handle:
        handle.write(b"".join(blocks))
    w = _Writer()
    w.flags(VECSXP, attr=True).i(3)
    w.flags(VECSXP, attr=True).i(len(offsets))
    for offset, length in offsets.values():
        w.ints([offset, length])
    w.flags(LISTSXP, tag=True).sym("names").strs(list(offsets)).nil()
    w.flags(VECSXP).i(0)
    w.flags(LGLSXP).i(1).i(compression)
    w.flags(LISTSXP, tag=True).ref(1).strs(["variables", "references", "compressed"]).nil()
    with open(prefix + ".rdx", "wb") as handle:
        handle.write(gzip.compress(w.bytes()))


def _self_test_pipeline():
    novel = ["TITLE", "", "By Someone", "", "VOLUME I", "", "CHAPTER I", "", "First line",
             "continues here.", "", "  Second para. ", "", "", "VOLUME II", "", "Chapter 2", "",
             None, "Last para.", "VOLUME I", "", "Finis", "", "A NOTE ON THE TEXT", "Editor."]
    with tempfile.TemporaryDirectory() as tmp:
        for compression in (1, 2):
            prefix = os.path.join(tmp, "Rdata%d" % compression)
            _write_fake_db(prefix, {variable: novel for variable, _ in NOVELS}, compression)
            out = os.path.join(tmp, "out%d" % compression)
            counts = convert([os.path.join(tmp, "missing"), prefix], out, "fake 0.0")
            _expect(counts == {"books": 6, "chapters": 12, "words": 6 * 17, "characters": counts["characters"]},
                    "pipeline counts %r" % counts)
            with open(os.path.join(out, "austen.jsonl"), encoding="utf-8") as handle:
                records = [json.loads(line) for line in handle]
            _expect(records[0] == {"text": "TITLE\n\nBy Someone\n\nCHAPTER I\n\nFirst line continues here."
                                           "\n\nSecond para.", "book": "Sense & Sensibility", "chapter": 1},
                    "first chapter %r" % records[0])
            _expect(records[1] == {"text": "Chapter 2\n\nLast para. VOLUME I", "book": "Sense & Sensibility",
                                   "chapter": 2}, "second chapter %r" % records[1])
            _expect([r["book"] for r in records[::2]] == [t for _, t in NOVELS], "book order")
        _write_fake_db(os.path.join(tmp, "partial"), {"emma": novel})
        _expect_error(lambda: convert([os.path.join(tmp, "partial")], os.path.join(tmp, "x"), "f"),
                      "lacks mansfieldpark")


def self_test():
    _self_test_unserialize()
    _self_test_pipeline()
    print("austen_to_jsonl self-test: OK")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", action="append", default=[],
                        help="lazy-load database path without .rdx/.rdb (repeatable)")
    parser.add_argument("--out", help="output directory")
    parser.add_argument("--source", default="unknown", help="source package and version for README")
    parser.add_argument("--self-test", action="store_true", help="check the parser on built-in data")
    args = parser.parse_args(argv)
    if args.self_test:
        self_test()
        return 0
    if not args.db or not args.out:
        parser.error("--db and --out are required (or use --self-test)")
    try:
        counts = convert(args.db, args.out, args.source)
    except (RFormatError, OSError, zlib.error) as error:
        print("austen_to_jsonl: error: %s" % error, file=sys.stderr)
        return 1
    print("austen: %d books, %d chapters, %d words, %d characters -> %s"
          % (counts["books"], counts["chapters"], counts["words"], counts["characters"],
             os.path.join(args.out, "austen.jsonl")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
