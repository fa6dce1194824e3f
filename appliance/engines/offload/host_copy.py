"""The host tier's copies on a worker whose KV lives in host memory already (vLLM's CPU
build): blocks copied between the worker's KV tensors and a host buffer with plain torch
indexing, for vLLM's OffloadingConnector (its `OffloadingWorker` interface). Loaded inside
vLLM only.

Model of the world (vLLM 0.32, `v1/kv_offload/base.py`): the connector hands over the KV as
`CanonicalKVCaches`, one int8 tensor of shape (num_blocks, page_bytes) per distinct KV
region and, per KV cache group, the regions its layers use. A store copies GPU blocks (the
`GPULoadStoreSpec`'s block ids, grouped by `group_sizes`) into host chunks (the
`CPULoadStoreSpec`'s chunk ids), a load the other way; a chunk holds `blocks_per_chunk`
blocks, the first of a group's run possibly entered part way (`block_indices`). Copies are
synchronous: a job is finished when `submit_*` returns, and `get_finished` reports it with
its bytes and time (vLLM's `kv_offload_*` metrics count them). vLLM's own CPU worker does
the same with CUDA streams and a DMA kernel, which the CPU build has not.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)


def sub_block_rows(chunk_ids: np.ndarray, per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Rows of a host buffer viewed one block a row: `count` blocks from the chunks, the
    first `skip` blocks of the first chunk left out."""
    if per_chunk == 1:
        return chunk_ids[:count].astype(np.int64)
    rows = (chunk_ids.astype(np.int64)[:, None] * per_chunk + np.arange(per_chunk)).ravel()
    return rows[skip : skip + count]


class TorchCopyWorker(OffloadingWorker):
    """Host buffers the shape of the worker's KV regions, `num_chunks` chunks each."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self._per_chunk = blocks_per_chunk
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for region in kv_caches.tensors:
            device = region.tensor  # int8, (num_blocks, page_bytes), maybe strided
            assert device.dtype == torch.int8 and device.ndim == 2, device.shape
            page = device.shape[1]
            host = torch.zeros((num_chunks * blocks_per_chunk, page), dtype=torch.int8)
            self._device.append(device)
            self._host.append(host)  # one block a row: chunk c is rows c*n .. c*n+n-1
        self._regions = [sorted({r.tensor_idx for r in g}) for g in kv_caches.group_data_refs]
        self._done: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._transfer(job_id, src_spec, dst_spec, to_host=True)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self._transfer(job_id, dst_spec, src_spec, to_host=False)
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy finished before its submit returned

    def shutdown(self) -> None:
        self._host.clear()
        self._device.clear()

    def _transfer(
        self, job_id: int, gpu: GPULoadStoreSpec, chunks: LoadStoreSpec, *, to_host: bool
    ) -> None:
        assert isinstance(chunks, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        moved = 0
        block_at = chunk_at = 0
        for group, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % self._per_chunk
            n_chunks = -(-(size + skip) // self._per_chunk)
            blocks = torch.from_numpy(gpu.block_ids[block_at : block_at + size].astype(np.int64))
            chunk_ids = chunks.block_ids[chunk_at : chunk_at + n_chunks]
            rows = torch.from_numpy(sub_block_rows(chunk_ids, self._per_chunk, skip, size))
            for region in self._regions[group]:
                device, host = self._device[region], self._host[region]
                if to_host:
                    host.index_copy_(0, rows, device.index_select(0, blocks))
                else:
                    device.index_copy_(0, blocks, host.index_select(0, rows))
                moved += size * device.shape[1]
            block_at += size
            chunk_at += n_chunks
        self._done.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
