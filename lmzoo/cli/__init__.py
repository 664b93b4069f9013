"""Command-line tools that read whole runs: the top of the import layers, beside train.py and eval.py.

- `python -m lmzoo.cli.export`: a run's checkpoint -> a HuggingFace folder (`lmzoo.convert.export`).
- `python -m lmzoo.cli.harness`: lm-eval with lmzoo's runs as the model "lmzoo" (`lmzoo.evaluation.harness`).
"""
