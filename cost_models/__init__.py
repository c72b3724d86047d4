"""Cost models: pure functions over specs that predict step time and memory per GPU.

Imports nothing else of ours. Hardware tables and presets live in `hardware`, the spec data in `specs`.
"""
