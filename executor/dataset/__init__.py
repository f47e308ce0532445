"""Real training data: a byte-level tokenizer, memory-mapped token shards and a resumable DP-aware sampler.

``foldtune data prepare`` (:func:`executor.dataset.prepare.prepare_dataset`) writes a directory of token
shards plus ``index.json``; :class:`executor.dataset.sampler.TokenDataset` opens it and
:class:`executor.dataset.sampler.BatchSampler` cuts global batches whose only state is the batch position.
"""
