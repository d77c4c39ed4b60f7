"""Request bookkeeping, plain Python (no torch): ``sequence.py`` (one request's state), ``scheduler.py``
(continuous batching) and ``scheduler_output.py`` (the one object a step hands the model runner)."""
