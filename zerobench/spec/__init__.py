"""The spec: what a cell is. A workload (workload.py) names a model (models.py, llama.py,
user_models.py), its data (data.py), activation checkpointing (checkpointing.py) and a
matrix of engines and their axes (matrix.py), which expands into cells."""
