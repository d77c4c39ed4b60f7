"""Structured outputs (vLLM's ``SamplingParams.structured_outputs``): a request's tokens follow a JSON schema, a
regex, a list of choices or an EBNF grammar, matched with xgrammar.

``compiler.py`` turns a request's constraint into a compiled grammar (once per constraint, cached; a bad one is a
ValueError naming the field); ``manager.py`` keeps one matcher per constrained request, builds each step's token
bitmask on the host (one row per logits row, drafts included) and advances the matchers by the tokens a step
emitted. The runner applies the bitmask to the logits before any token is sampled or verified
(``layers/token_bitmask.py``). xgrammar is imported only when a request asks for structured output.
"""
