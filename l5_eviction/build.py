"""Building an engine: its pool and allocator sized and checked against the machine first."""

from __future__ import annotations

from l1_contiguous import InputError
from l2_paged.allocator import check_pool_shape

from .engine import Engine
from .workload import available_host_memory


def make_engine(model, num_blocks: int, block_size: int = 16, engine_cls: type[Engine] = Engine,
                **kwargs) -> Engine:
    """Pool (`engine_cls.pool_cls`), allocator (`engine_cls.allocator_cls`) and engine in one call;
    InputError for a pool that cannot exist (a size that is not a positive int, or more bytes than
    the device has)."""
    check_pool_shape(num_blocks, block_size)
    need = num_blocks * engine_cls.pool_cls.bytes_per_block(model.config, block_size, model.dtype)
    free = available_host_memory()
    if model.device.type == "cpu" and free is not None and need > free:
        # torch.empty would succeed (pages are only reserved), and the run would die or swap later
        raise InputError(f"a pool of {num_blocks:,} blocks of {block_size} tokens needs {need / 2**30:,.1f} GiB, "
                         f"more than the {free / 2**30:,.1f} GiB of memory available; ask for fewer blocks "
                         f"(or fewer requests and samples)")
    try:
        pool = engine_cls.pool_cls(model.config, num_blocks, block_size, model.dtype, model.device)
    except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
        raise InputError(f"cannot allocate a pool of {num_blocks:,} blocks of {block_size} tokens on "
                         f"{model.device}; ask for fewer blocks") from None
    return engine_cls(model, pool, engine_cls.allocator_cls(num_blocks, block_size), **kwargs)

