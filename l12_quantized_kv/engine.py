"""L12's engine: L8's, on a quantized pool, with block keys that name the scales they were written under.

A cached block holds codes, and codes mean nothing without the scales that made them. L8 keys a
block by its tokens alone; here every key the allocator stores or looks up is first combined with
the pool's cache tag (the format and every scale, quantize.cache_tag). Recalibrating an engine
(`set_scales`) changes the tag, so blocks written before stop matching and age out of the cache
as any unused block does; a pool that reads them with the new scales would silently compute with
wrong values.
"""

from __future__ import annotations

from pathlib import Path

import torch

from l1_contiguous import InputError
from l2_paged import blocks_needed
from l2_paged.allocator import check_pool_shape
from l5_eviction import WorkItem, load_engine_model
from l5_eviction.workload import available_host_memory
from l8_prefix import PrefixEngine, tagged_key
from l8_prefix.prefix_allocator import PrefixBlockAllocator

from .attention import QuantizedAttention
from .pool import CalibrationPool, QuantizedKvPool
from .quantize import KvFormat, KvScales, scales_from_amax


class TaggedPrefixAllocator(PrefixBlockAllocator):
    """L8's allocator; every key is stored and looked up within the pool's cache tag."""

    tag = b""

    def lookup(self, keys):
        return super().lookup([tagged_key(self.tag, k) for k in keys])

    def register(self, block, key):
        if not isinstance(key, bytes):
            return super().register(block, key)  # L8's refusal, with L8's message
        super().register(block, tagged_key(self.tag, key))


class QuantizedEngine(PrefixEngine):
    allocator_cls = TaggedPrefixAllocator

    def __init__(self, model, pool: QuantizedKvPool, alloc: TaggedPrefixAllocator, **kwargs):
        if not isinstance(pool, QuantizedKvPool):
            raise InputError(f"a QuantizedEngine needs a QuantizedKvPool, got {type(pool).__name__}")
        super().__init__(model, pool, alloc, **kwargs)
        alloc.tag = pool.tag

    def set_scales(self, scales: KvScales) -> None:
        """Read and write with new scales from the next step on. Only between requests: a running
        request's blocks hold codes made under the old ones."""
        if self.has_unfinished():
            raise InputError("set_scales between requests only: running requests hold codes made "
                             "under the current scales")
        self.pool.set_scales(scales)
        self.alloc.tag = self.pool.tag

    def summary(self) -> dict:
        return {**super().summary(), "kv_format": self.pool.fmt.name,
                "kv_scales": self.pool.scales.granularity, "pool_bytes": self.pool.nbytes()}


def load_quantized_model(model_dir: str | Path, dtype=torch.float32, device="cpu", packed_linears: bool = True):
    """L5's engine model with L12's attention (it still runs mixed steps)."""
    return load_engine_model(model_dir, dtype, device, packed_linears, attention_cls=QuantizedAttention)


def quantized_bytes_per_block(cfg, block_size: int) -> int:
    return block_size * cfg.kv_bytes_per_token(1)


def make_quantized_engine(model, scales: KvScales, num_blocks: int, block_size: int = 16,
                          **kwargs) -> QuantizedEngine:
    """Pool, allocator and engine; InputError for a pool that cannot exist on this machine."""
    check_pool_shape(num_blocks, block_size)
    need = num_blocks * quantized_bytes_per_block(model.config, block_size)
    free = available_host_memory()
    if model.device.type == "cpu" and free is not None and need > free:
        raise InputError(f"a pool of {num_blocks:,} blocks needs {need / 2**30:,.1f} GiB, more than the "
                         f"{free / 2**30:,.1f} GiB available; ask for fewer blocks")
    pool = QuantizedKvPool(model.config, num_blocks, block_size, scales, model.device)
    return QuantizedEngine(model, pool, TaggedPrefixAllocator(num_blocks, block_size), **kwargs)


def calibrate(model, prompts: list[list[int]], fmt: KvFormat, granularity: str,
              block_size: int = 16) -> KvScales:
    """Scales from one float prefill of each calibration prompt (the model's own K and V, after
    RoPE, as the pool would store them). "one" needs no run."""
    cfg = model.config
    if granularity != "one":
        if not prompts or not all(prompts):
            raise InputError("calibration needs at least one non-empty prompt")
        num_blocks = sum(blocks_needed(len(p) + 1, block_size) for p in prompts)
        pool = CalibrationPool(cfg, num_blocks, block_size, model.dtype, model.device)
        engine = PrefixEngine(model, pool, PrefixBlockAllocator(num_blocks, block_size), prefix_sharing=False)
        engine.run([WorkItem(list(p), 1) for p in prompts])
        k_amax, v_amax = pool.k_amax, pool.v_amax
    else:
        k_amax = v_amax = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads)
    k = scales_from_amax(k_amax, granularity, fmt)
    v = scales_from_amax(v_amax, granularity, fmt)
    return KvScales(fmt, list(k.cpu()), list(v.cpu()), granularity)
