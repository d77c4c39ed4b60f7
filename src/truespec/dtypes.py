"""The model dtypes a user may name, in one table: the config's check and the loader both read it.

Names only (no torch), so config.py stays importable without torch; models/loader.py resolves each name to
``getattr(torch, DTYPE_NAMES[name])``.
"""

DTYPE_NAMES: dict[str, str] = {  # accepted name -> torch dtype attribute
    "float64": "float64", "double": "float64", "fp64": "float64",
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}  # fmt: skip
DTYPES = ("auto", *DTYPE_NAMES)  # "auto": the checkpoint's own dtype (models/loader.py's resolve_dtype)
