"""Memory-mapped indexed datasets: the on-disk format of the data-analysis index files.

The format is Megatron's / DeepSpeed's ``MMIDIDX`` pair, so files written by DeepSpeed's
``DataAnalyzer`` load here and the other way round:

* ``<prefix>.bin``: the items' elements back to back, one integer dtype;
* ``<prefix>.idx``: magic ``b"MMIDIDX\\x00\\x00"``, version ``<Q 1``, dtype code ``<B``,
  item count ``<Q``, document count ``<Q``, then the item sizes (int32), the items' byte
  offsets into ``.bin`` (int64) and the document index (int64).

Item ``i`` is a 1-D numpy array (a view into the memory map).
"""
from __future__ import annotations

import os
import shutil
import struct

import numpy as np
import torch

_HDR_MAGIC = b"MMIDIDX\x00\x00"

#: dtype code -> (numpy dtype, torch dtype or None): DeepSpeed's codes.
dtypes = {1: (np.uint8, torch.uint8), 2: (np.int8, torch.int8), 3: (np.int16, torch.int16),
          4: (np.int32, torch.int32), 5: (np.int64, torch.int64), 6: (np.uint16, None),
          7: (np.uint32, None), 8: (np.uint64, None)}

valid_dtypes = set([d[0] for d in dtypes.values()] + [d[1] for d in dtypes.values() if d[1] is not None])


def code(dtype) -> int:
    for c, (np_dt, torch_dt) in dtypes.items():
        if isinstance(dtype, torch.dtype):
            if dtype == torch_dt:
                return c
        elif np.dtype(dtype) == np.dtype(np_dt):
            return c
    raise ValueError(f"{dtype} is not supported for indexed datasets; supported: {sorted(map(str, valid_dtypes))}")


def _np_dtype(dtype):
    return dtypes[code(dtype)][0]


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


class MMapIndexedDataset(torch.utils.data.Dataset):
    """Read ``<path>.idx``/``<path>.bin``; ``ds[i]`` is item ``i`` (``ds[a:b]`` a list)."""

    def __init__(self, path: str, skip_warmup: bool = True):
        self._path = path
        idx = index_file_path(path)
        if not (os.path.isfile(idx) and os.path.isfile(data_file_path(path))):
            raise FileNotFoundError(f"Indexed dataset '{path}': expected '{idx}' and '{data_file_path(path)}'.")
        with open(idx, "rb") as f:
            if f.read(9) != _HDR_MAGIC:
                raise ValueError(f"'{idx}' is not an MMIDIDX index file.")
            version, = struct.unpack("<Q", f.read(8))
            if version != 1:
                raise ValueError(f"'{idx}': unsupported index version {version}.")
            dtype_code, = struct.unpack("<B", f.read(1))
            self._dtype = dtypes[dtype_code][0]
            self._len, = struct.unpack("<Q", f.read(8))
            self._doc_count, = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        index = np.memmap(idx, mode="r", order="C")
        self._sizes = np.frombuffer(index, dtype=np.int32, count=self._len, offset=offset)
        self._pointers = np.frombuffer(index, dtype=np.int64, count=self._len, offset=offset + self._sizes.nbytes)
        self._doc_idx = np.frombuffer(index, dtype=np.int64, count=self._doc_count,
                                      offset=offset + self._sizes.nbytes + self._pointers.nbytes)
        self._index_mmap = index
        self._bin = np.memmap(data_file_path(path), mode="r", order="C") \
            if os.path.getsize(data_file_path(path)) > 0 else np.zeros(0, dtype=np.uint8)

    def __len__(self) -> int:
        return self._len

    def _item(self, i: int) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self._dtype, count=int(self._sizes[i]), offset=int(self._pointers[i])) \
            if self._sizes[i] else np.zeros(0, dtype=self._dtype)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            if idx < 0:
                idx += self._len
            if not 0 <= idx < self._len:
                raise IndexError(f"index {idx} out of range for {self._len} items")
            return self._item(int(idx))
        if isinstance(idx, slice):
            return [self._item(i) for i in range(*idx.indices(self._len))]
        raise TypeError(f"indices must be int or slice, got {type(idx).__name__}")

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def dtype(self):
        return self._dtype

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


class MMapIndexedDatasetBuilder:
    """Append items to ``<prefix>.bin``; :meth:`finalize` writes ``<prefix>.idx``."""

    def __init__(self, out_file: str, dtype=np.int64):
        self._data_file = open(out_file, "wb")
        self._dtype = _np_dtype(dtype)
        self._sizes = []
        self._doc_idx = [0]

    def add_item(self, tensor) -> None:
        arr = np.asarray(tensor.numpy() if torch.is_tensor(tensor) else tensor).astype(self._dtype).reshape(-1)
        self._data_file.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)

    def add_item_numpy(self, arr: np.ndarray) -> None:
        self.add_item(arr)

    def add_items(self, arr_list) -> None:
        for arr in arr_list:
            self.add_item(arr)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_prefix: str) -> None:
        other = MMapIndexedDataset(another_prefix)
        if np.dtype(other.dtype) != np.dtype(self._dtype):
            raise ValueError(f"merge_file_: '{another_prefix}' holds {np.dtype(other.dtype)}, this builder "
                             f"{np.dtype(self._dtype)}.")
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in other.sizes)
        self._doc_idx.extend(int(d) + offset for d in other.doc_idx[1:])
        with open(data_file_path(another_prefix), "rb") as f:
            shutil.copyfileobj(f, self._data_file)

    def finalize(self, index_file: str) -> None:
        self._data_file.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        itemsize = np.dtype(self._dtype).itemsize
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1] * itemsize)
        tmp = index_file + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_HDR_MAGIC)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", code(self._dtype)))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(self._doc_idx)))
            f.write(sizes.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._doc_idx, dtype=np.int64).tobytes(order="C"))
        os.replace(tmp, index_file)  # the .idx appears only complete: a reader never sees half a file
