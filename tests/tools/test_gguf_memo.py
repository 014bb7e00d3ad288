#!/usr/bin/env python3
"""Tests of python/gguf_memo.py, with gguf-py (PyPI `gguf`, tools/requirements.txt) on small files
gguf-py writes: one reader per file while the file is unchanged, a file written again parsed again
(its new values read), writable maps never shared, and the memoized tensor-name maps the same as
gguf-py's own. A few seconds.

  ~/.cache/weft/venv/bin/python tests/tools/test_gguf_memo.py
"""
import os
import sys
import tempfile
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import gguf  # noqa: E402

PARSE = gguf.GGUFReader
NAME_MAP = gguf.get_tensor_name_map

import gguf_memo  # noqa: E402

gguf_memo.install()


def write(path, values, name="tok"):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", name)
    writer.add_tensor("blk.0.attn_q.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor(reader):
    return np.asarray(reader.tensors[0].data)


class GgufMemo(unittest.TestCase):
    def test_a_file_is_parsed_once_until_it_is_written_again(self):
        with tempfile.TemporaryDirectory() as work:
            path = os.path.join(work, "model.gguf")
            first = np.arange(32, dtype=np.float32).reshape(4, 8)
            write(path, first)
            reader = gguf.GGUFReader(path)
            self.assertIs(gguf.GGUFReader(path), reader)
            self.assertIs(gguf.GGUFReader(os.path.join(work, ".", "model.gguf")), reader)  # the same file
            np.testing.assert_array_equal(tensor(reader), first)
            np.testing.assert_array_equal(tensor(reader), tensor(PARSE(path)))
            # written again (other values, another size): parsed again, the new values read
            second = np.full((4, 16), 7.0, dtype=np.float32)
            os.replace(path, path + ".old")  # the old map stays valid on its own inode
            write(path, second, name="another")
            again = gguf.GGUFReader(path)
            self.assertIsNot(again, reader)
            np.testing.assert_array_equal(tensor(again), second)
            self.assertEqual(again.fields["general.name"].contents(), "another")
            np.testing.assert_array_equal(tensor(reader), first)

    def test_writable_maps_are_never_shared(self):
        with tempfile.TemporaryDirectory() as work:
            path = os.path.join(work, "model.gguf")
            write(path, np.ones((2, 8), dtype=np.float32))
            self.assertIsNot(gguf.GGUFReader(path, "r+"), gguf.GGUFReader(path, "r+"))
            self.assertIsNot(gguf.GGUFReader(path, "r+"), gguf.GGUFReader(path))

    def test_tensor_name_maps_are_gguf_pys(self):
        arch = gguf.MODEL_ARCH.LLAMA
        memo = gguf.get_tensor_name_map(arch, 30)
        self.assertIs(gguf.get_tensor_name_map(arch, 30), memo)
        fresh = NAME_MAP(arch, 30)
        for name in ("model.layers.3.self_attn.q_proj", "model.layers.29.mlp.down_proj", "model.embed_tokens",
                     "lm_head", "model.norm"):
            self.assertEqual(memo.get_name(name), fresh.get_name(name), name)
        self.assertEqual(memo.get_name("model.layers.3.self_attn.q_proj"), "blk.3.attn_q")

    def test_installing_twice_changes_nothing(self):
        reader_fn, map_fn = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf_memo.install()
        self.assertIs(gguf.GGUFReader, reader_fn)
        self.assertIs(gguf.get_tensor_name_map, map_fn)


if __name__ == "__main__":
    unittest.main()
