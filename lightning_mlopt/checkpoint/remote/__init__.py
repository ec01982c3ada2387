"""The remote tier: checkpoints in an S3-compatible object store, behind a local tier that saves commit to.

- ``object_store.py``: the store's few operations (put, get, list, create-only), over ``s3_client.py``.
- ``checkpoints.py``: :class:`RemoteCheckpoints`, committed checkpoints in the store (upload, verify, retain).
- ``replicator.py``: copies committed local checkpoints up in the background, when due.
- ``tiers.py``: where a run's checkpoints commit, and the store reached before training.
"""
