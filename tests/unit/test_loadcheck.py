"""Opening a pulled file as its framework would (controller/results/loadcheck.py): the file's
sha256 matched a MANIFEST the box or the store wrote, so its bytes are still untrusted input.
Whatever they hold, the check ends in its answer or in an IntegrityError naming the file,
never another exception (a traceback from `rgt pull`), and never in minutes of arithmetic."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from controller.results.loadcheck import check_format, check_safetensors, check_torch
from onbox.common.errors import IntegrityError


def _safetensors(tmp_path: Path, tensors: Dict[str, Any], data_len: int) -> str:
    """A .safetensors file built by hand: u64 header length, the JSON header, the data."""
    header = json.dumps(tensors).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * data_len)
    return str(path)


def _tensor(dtype: Any = "F32", shape: Any = (4,), offsets: Any = (0, 16)) -> Dict[str, Any]:
    return {"w": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


def test_a_well_formed_safetensors_file_passes(tmp_path: Path) -> None:
    path = _safetensors(tmp_path, _tensor(), 16)
    assert check_format(path, "m.safetensors") == "sha256 + safetensors header"
    # An empty tensor: a 0 dim makes any other dim 0 bytes.
    check_safetensors(_safetensors(tmp_path, _tensor(shape=[0, 2**62], offsets=[0, 0]), 0), "m")


@pytest.mark.parametrize(
    "tensor",
    [
        _tensor(dtype=["F32"]),  # a list: unhashable, it raised TypeError
        _tensor(dtype=None),
        {"w": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}},
        _tensor(shape=[True] * 4),  # JSON true: an int to Python, not a dim
        _tensor(shape=[4.0]),
        _tensor(shape=[-4]),
        _tensor(offsets=[0, 16, 32]),
        {"w": ["F32", [4], [0, 16]]},
    ],
    ids=["dtype-list", "dtype-null", "shape-str", "shape-bool", "shape-float", "shape-negative",
         "three-offsets", "tensor-list"],
)  # fmt: skip
def test_a_tensor_of_the_wrong_types_is_an_integrity_error(
    tmp_path: Path, tensor: Dict[str, Any]
) -> None:
    with pytest.raises(IntegrityError, match="no valid dtype, shape and data_offsets"):
        check_safetensors(_safetensors(tmp_path, tensor, 16), "m.safetensors")


def test_a_shape_that_does_not_fill_its_bytes_says_what_it_needs(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match=r"F32\[2, 3\] needs 24 bytes, has 16"):
        check_safetensors(_safetensors(tmp_path, _tensor(shape=[2, 3]), 16), "m.safetensors")


@pytest.mark.parametrize("dims", [300, 100_000])
def test_a_shape_of_huge_dims_is_refused_in_one_short_line(tmp_path: Path, dims: int) -> None:
    """300 dims of 2**62: a product of over 4300 digits, which the error message could not
    format (ValueError). 100,000 of them: the product was a bigint that took minutes to grow;
    it stops once it passes the tensor's bytes, so this test is quick."""
    shape: List[int] = [2**62] * dims
    path = _safetensors(tmp_path, _tensor(shape=shape), 16)
    with pytest.raises(IntegrityError) as info:
        check_safetensors(path, "m.safetensors")
    assert f"F32[{dims} dims] needs more than 2**64 bytes, has 16" in info.value.what
    assert len(info.value.line()) < 300


def _zip(names: List[str], version_needed: int = 20) -> bytes:
    """A zip file holding ``names``, its central directory claiming ``version_needed``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in names:
            z.writestr(name, b"x" * 50)
    data = bytearray(buf.getvalue())
    cd = data.find(b"PK\x01\x02")
    data[cd + 6] = version_needed  # "version needed to extract", as major * 10 + minor
    return bytes(data)


def test_a_plain_zip_is_not_opened_as_a_torch_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(_zip(["a.txt"]))
    assert (
        check_torch(str(path), "data.bin")
        == "sha256 (a zip file, not a torch checkpoint: not opened)"
    )


def test_a_zip_that_pythons_zipfile_will_not_read_goes_to_torchs_own_reader(
    tmp_path: Path,
) -> None:
    """Version 9.9 needed to extract: Python's zipfile raised NotImplementedError (a traceback
    from `rgt pull`); torch.load now decides, and this one is no checkpoint it can open."""
    path = tmp_path / "model.pt"
    path.write_bytes(_zip(["archive/data.pkl"], version_needed=99))
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "torch is not installed" in check_torch(str(path), "model.pt")
        return
    with pytest.raises(IntegrityError, match=r"^model\.pt: torch\.load cannot open it"):
        check_torch(str(path), "model.pt")
