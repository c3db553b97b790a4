"""Model folders on disk: this project's checkpoints (checkpoint.py), sharded weights (shard.py), pretrained
base LMs (base_models.py), deltas over a base (delta.py, written by delta_extract.py), and load.py, which
tells a folder's kind and loads it.

Above engine/model and engine/families; nothing there imports this package.
"""
