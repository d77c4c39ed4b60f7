"""What the tests share, in one package (importable because pytest puts tests/, the rootdir of conftest.py,
on sys.path):

* ``models``: tiny random HF configs and checkpoints, hand-built ForwardContexts, a naive cache-owning runner;
* ``kernels``: Triton's interpreter on CPU, tolerances, random inputs, ragged batch metadata;
* ``tokenizer``: the tiny real tokenizer saved beside every tiny engine checkpoint;
* ``engine``: seeded prompts, ``LLM`` helpers, an oracle draft proposer.

No submodule is imported here: importing ``helpers.kernels`` switches Triton to its interpreter when there is
no CUDA, which must stay each test module's explicit choice."""

# The one vocabulary of every tiny model: the model-level configs (helpers.models) and the engine checkpoints
# (conftest.py). Engine prompts draw ids in [1, 300), which must be tokens of the tiny tokenizer (conftest saves
# save_tokenizer(dir, VOCAB_SIZE - 8): 311 tokens, <eos> included) and rows of the embedding; the rows past the
# tokenizer stay unused, as in real checkpoints whose embedding is padded. The model-level tests' old 131 could
# hold neither (the byte-level alphabet alone is 256 tokens).
VOCAB_SIZE = 320
