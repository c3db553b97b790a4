"""The model: its config (config.py), the one decoder architecture (transformer.py) and its weights files
read safely (weight_files.py).

The bottom layer of loading: engine/families builds on it, engine/weights on both; nothing here
imports either.
"""
