"""The array backends the store allocates its K/V on: numpy on the host, torch tensors on CPU or CUDA.

Rows are written on the array's own device and bound to ONNX Runtime by data pointer, so joins,
moves, leaves and each step's new column never cross the bus. torch is imported only when a
`TorchArrays` is made: the CPU serving path runs without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from contract.cache_policy import INT8
from contract.kv_int8 import CHANNEL_QMIN, QMAX, quantize_channels, quantize_numpy

Array = Any  # np.ndarray or torch.Tensor, as the backend makes them


class NumpyArrays:
    """Host memory (the CPU serving path)."""

    device_type = "cpu"
    device_id = 0

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """Uninitialised: for arrays every element of which is written before it is read."""
        return np.empty(shape, dtype=dtype)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def download(self, array: np.ndarray) -> np.ndarray:
        return array

    def pointer(self, array: np.ndarray) -> int:
        assert array.flags.c_contiguous
        return int(array.ctypes.data)

    def concatenate(self, arrays: list[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(arrays, axis=axis)

    def rows_first(self, array: np.ndarray) -> np.ndarray:
        return np.swapaxes(array, 0, 1)

    def synchronize(self) -> None:
        """Host arrays: writes are done when the call returns."""

    def arange(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64)

    def copy(self, array: np.ndarray) -> np.ndarray:
        return array.copy()

    def quantize(self, array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int8 values and float32 per-token scales (contract.kv_int8)."""
        return quantize_numpy(array)

    def quantize_channels(self, array: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """int8 values in the channel format (contract.kv_int8), `scales` broadcasting against `array`."""
        return quantize_channels(array, scales)


class TorchArrays:
    """torch tensors on a device (CUDA in production; CPU in CI, to run the GPU path's code),
    bound to ONNX Runtime by data pointer as Hugging Face Optimum's ONNX Runtime models do."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.device_type = self.device.type
        self.device_id = self.device.index or 0
        self._dtypes = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, INT8: torch.int8}

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Array:
        return self.torch.zeros(shape, dtype=self._dtypes[dtype], device=self.device)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Array:
        return self.torch.empty(shape, dtype=self._dtypes[dtype], device=self.device)

    def upload(self, array: np.ndarray) -> Array:
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def download(self, array: Array) -> np.ndarray:
        return array.detach().cpu().numpy()

    def pointer(self, array: Array) -> int:
        assert array.is_contiguous()
        return int(array.data_ptr())

    def concatenate(self, arrays: list[Array], axis: int) -> Array:
        return self.torch.cat(arrays, dim=axis)

    def rows_first(self, array: Array) -> Array:
        return array.transpose(0, 1)

    def synchronize(self) -> None:
        """Wait for torch's queued writes before ONNX Runtime, on its own CUDA stream, reads them."""
        if self.device_type == "cuda":
            self.torch.cuda.current_stream(self.device).synchronize()

    def arange(self, n: int) -> Array:
        return self.torch.arange(n, dtype=self.torch.int64, device=self.device)

    def copy(self, array: Array) -> Array:
        return array.clone()

    def quantize(self, array: Array) -> tuple[Array, Array]:
        """contract.kv_int8.quantize_numpy in torch, on the array's device (the same rounding: half to even)."""
        torch = self.torch
        array = array.to(torch.float32)
        top = array.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(top > 0, top / QMAX, torch.ones_like(top))
        return torch.clamp(torch.round(array / scale), -QMAX, QMAX).to(torch.int8), scale

    def quantize_channels(self, array: Array, scales: Array) -> Array:
        """contract.kv_int8.quantize_channels in torch (the same rounding: half to even)."""
        torch = self.torch
        return torch.clamp(torch.round(array.to(torch.float32) / scales), CHANNEL_QMIN, QMAX).to(torch.int8)


Backend = NumpyArrays | TorchArrays


def make_backend(on_gpu: bool, kind: str = "auto") -> Backend:
    """numpy on the CPU; torch tensors on CUDA. `kind="torch"` runs the torch path on the CPU."""
    if on_gpu:
        return TorchArrays("cuda")
    if kind == "torch":
        return TorchArrays("cpu")
    if kind not in ("auto", "numpy"):
        raise ValueError(f"kv backend must be auto, numpy or torch, got {kind!r}")
    return NumpyArrays()
