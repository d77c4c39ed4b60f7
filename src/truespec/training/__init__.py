"""How truespec's embedded default model is made, reproducibly, from one command.

`python -m truespec.training --out DIR` collects the interpreter's standard library (corpus.py), trains a
byte-level BPE tokenizer (tokenizer.py), builds fast-apply edit and docstring->function chat tasks
(tasks.py), trains the hybrid Qwen3.5 target with its MTP layer and a dense Qwen3 draft together
(models.py, data.py, train.py), evaluates them on held-out files (evaluate.py), and writes the HF-format
asset directories plus a training report (export.py, report.py). See MODEL.md.
"""
