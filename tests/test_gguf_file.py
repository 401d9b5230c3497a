"""engine/model/gguf_file.py: the fast GGUF reader agrees with gguf-py's reader, and says what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from specplan.engine.model.gguf_file import GGUFFile, GGUFFormatError
from specplan.engine.model.loader import ModelLoadError, load_model


def _write(path, alignment: int | None = None) -> None:
    """Every kind of metadata (scalars, strings, arrays of numbers and of strings, an array of
    arrays) and tensors of five types, of rank 1 and 2, at a non-default alignment if asked."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -3)
    w.add_float32("test.f32", 0.5)
    w.add_bool("test.bool", True)
    w.add_string("test.text", "héllo")
    w.add_array("test.numbers", [1, 2, 3])
    w.add_array("test.words", ["a", "bb", "ccc"] * 50)
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("f32.matrix", rng.standard_normal((3, 64), dtype=np.float32))
    w.add_tensor("f16.vector", rng.standard_normal(40).astype(np.float16))
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = GGMLQuantizationType[kind]
        w.add_tensor(f"{kind}.matrix", quants.quantize(rng.standard_normal((5, 96), dtype=np.float32), qtype),
                     raw_dtype=qtype)
    w.add_string("test.after", "last")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_and_metadata_match_gguf_py(tmp_path, alignment):
    path = tmp_path / "mixed.gguf"
    _write(path, alignment)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.type_name == b.tensor_type.name and a.data_offset == b.data_offset and a.nbytes == b.n_bytes
        raw = ours.raw(a)
        assert raw.shape == b.data.shape and raw.dtype == b.data.dtype, a.name
        assert np.array_equal(raw, b.data), a.name
    assert ours.raw(ours.tensors[2]).shape == (5, 96 // 32 * 18)  # Q4_0: rows of 18-byte blocks
    for key in ("test.u32", "test.i64", "test.bool", "test.text", "test.after"):
        field = theirs.fields[key]
        value = field.contents()
        assert ours.metadata[key] == value, key
    assert ours.metadata["test.f32"] == pytest.approx(0.5)
    # Arrays are stepped over (the vocabulary is most of a model's metadata), not kept.
    assert not {"test.numbers", "test.words", "test.nested"} & set(ours.metadata)
    if alignment is not None:
        assert ours.metadata["general.alignment"] == alignment


def test_truncated_bad_and_old_files_are_named(tmp_path):
    path = tmp_path / "mixed.gguf"
    _write(path)
    data = path.read_bytes()
    for cut in (10, 200, len(data) - 100):  # in the header, the metadata, the last tensor's data
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match="truncated|past the end"):
            GGUFFile(short)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFFile(old)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFFile(bad)


def test_a_truncated_gguf_fails_quantized_loading_in_one_line(tmp_path):
    path = tmp_path / "mixed.gguf"
    _write(path)
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ModelLoadError) as e:
        load_model(short, cache_dir=tmp_path / "cache", quantize="gguf")
    message = str(e.value)
    assert "\n" not in message and "cannot read GGUF" in message and "truncated" in message
