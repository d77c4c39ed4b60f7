"""The device side of a step: ``model_runner.py`` (scheduler output -> forward -> sampled tokens),
``input_builder.py`` (packed step tensors and the ForwardContext), ``graph_runner.py`` (eager or CUDA-graph
forwards) and ``runner_output.py`` (what a step returns)."""
