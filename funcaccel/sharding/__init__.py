"""Pure index arithmetic that shards batch samplers and iterable datasets.

Nothing here touches ``torch.distributed``: ``_batch_sampler.py`` shards batch
samplers, ``_iterable.py`` streams, ``_common.py`` holds what both share. The rules
are in docs/sharding.md.
"""

from __future__ import annotations

from funcaccel.sharding._batch_sampler import ShardedBatchSampler
from funcaccel.sharding._batch_sampler import shard_batch_sampler
from funcaccel.sharding._iterable import ShardedIterableDataset
from funcaccel.sharding._iterable import shard_iterable_dataset

__all__ = [
    "shard_batch_sampler",
    "shard_iterable_dataset",
    "ShardedBatchSampler",
    "ShardedIterableDataset",
]
