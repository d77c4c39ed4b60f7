"""Prompt-lookup (n-gram) drafting: find the longest suffix n-gram seen earlier, propose what followed.

The drafts: ``min(k, max_drafts)`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram
(n from max_n down to min_n; an occurrence starts before ``len - n``, so it is not the suffix itself), [] when none
occurred. Where fewer tokens follow the occurrence (it is recent: the text repeats with the period from it to the end),
they are repeated: vLLM stops at the end, but a loop, or an edit copying repeated lines, goes on with the same period
(mean acceptance length on the embedded model's edit prompts: BENCHMARKS.md). Scanning the whole history for that on
every step costs O(len) host time per request, milliseconds a step at batch size 64 with long contexts, while a decode
step on the device takes one or two; so each request keeps an index that grows with its tokens (tokens are only ever
appended: prompt, then output, kept across preemption), and a step costs per request and per n a hash of each new
token's n-gram and a look into one bucket: no work grows with the context but the rare rebuild when the positions
outgrow the buckets (each rebuild doubles them: O(1) per token amortized).

The index, per n in [min_n, max_n], is a pair of hash chains as in zlib's deflate: ``heads[bucket]`` is the last
position where an n-gram of that bucket ended and ``prev[p]`` the one before p in p's bucket, so a bucket's
positions are walked newest first and the first whose n-gram equals the suffix is the answer for that n.
Memory per token: the token list (8 bytes, the int objects are the engine's) and per n an int32 ``prev`` (4) and
the int32 heads (4 to 16: between 1 and 4 buckets per position), so about 8 + 12 * (max_n - min_n + 1) bytes;
24 bytes for vLLM's default min_n = max_n. A request's index is dropped when ``finished_req_ids`` names it.
"""

from array import array

from truespec.core.sequence import Sequence
from truespec.spec_decode.device_drafts import DeviceDrafts
from truespec.spec_decode.interface import DraftRequest, Drafts
from truespec.spec_decode.ngram_on_device import NgramOnDevice
from truespec.worker.model_runner import LaunchedStep
from truespec.worker.runner_output import ModelRunnerOutput

MIN_BUCKETS = 64


class NgramProposer:
    """Prompt-lookup drafts from one ``NgramIndex`` per request, kept from its first drafting step to its finish;
    behind a greedy step queued on the device, from the device's copy of the tokens (ngram_on_device.py)."""

    catches_up = False  # a request's index catches up on its tokens when it drafts
    defers_while_off = True  # while drafting is off, nothing is drafted on the device (nor indexed on the host)
    num_lookahead_tokens = device_reach = 0  # it writes no KV
    drafts_after_prompts = False  # on the device only behind decodes / verifies (its token history is built there)

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 draft_on_device: bool = False) -> None:
        self.can_draft_on_device = draft_on_device  # speculative_config.draft_on_device
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}  # by request id, built on a request's first drafting step
        self.on_device = NgramOnDevice(self.k, self.min_n, self.max_n)

    def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                finished_req_ids: list[str]) -> dict[str, Drafts]:
        """Drafts for each request that just got a new token (ngram drafts are one-hot: no probabilities).
        A request that does not draft this step is not indexed now: its next drafting step catches up."""
        self.forget(finished_req_ids)  # first: a finished id may come back as a new request in this step
        drafts = {}
        for r in requests:
            if r.is_drafting:
                limit = min(self.k, r.max_drafts)
                drafts[r.request_id] = Drafts(self._index(r).lookup(limit) if limit > 0 else [])
        return drafts

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.indexes.pop(request_id, None)
        self.on_device.forget(request_ids)

    def is_behind(self, request_ids: list[str]) -> bool:
        return False  # nothing to catch up: a request's tokens are copied when it drafts

    def draft_on_device(self, step: LaunchedStep, num_drafts: int, seqs: dict[str, Sequence]) -> DeviceDrafts:
        """``NgramOnDevice.draft_on_device``; ``seqs``: the engine's requests."""
        self.forget(step.sched.finished_req_ids)  # the host indexes too (the device's rows: there)
        return self.on_device.draft_on_device(step, num_drafts, seqs)

    def _index(self, r: DraftRequest) -> "NgramIndex":
        """``r``'s index, caught up on its new tokens; a fresh one when ``r`` is new, is another request under a
        reused id, or its tokens no longer start with the indexed ones (which the engine never does: rebuilding
        is the safe answer, as a stale index would only cost drafts, never correctness)."""
        index = self.indexes.get(r.request_id)
        if index is None or not index.catch_up(r):
            index = self.indexes[r.request_id] = NgramIndex(self.min_n, self.max_n, r)
            index.catch_up(r)
        return index


class NgramIndex:
    """One request's tokens so far and, for each n in [min_n, max_n], where each n-gram followed by a token ended."""

    def __init__(self, min_n: int, max_n: int, r: DraftRequest) -> None:
        # the engine's own lists (interface.py): the same objects for as long as the request lives
        self.prompt_token_ids, self.output_token_ids = r.prompt_token_ids, r.output_token_ids
        self.token_ids: list[int] = []
        self.chains = [HashChains(n) for n in range(max_n, min_n - 1, -1)]  # longest n first

    def catch_up(self, r: DraftRequest) -> bool:
        """Index the tokens ``r`` gained since the last call (any number: it may have skipped steps). False, and
        nothing done, unless ``r`` is the indexed request (the same lists) and still starts with the indexed
        tokens: no fewer, the last one unchanged. O(1), so a token changed further back would go unseen: the engine
        only appends (async scheduling's placeholder is replaced by the real token before any proposer runs)."""
        prompt, output, token_ids = r.prompt_token_ids, r.output_token_ids, self.token_ids
        num_indexed, prompt_len = len(token_ids), len(prompt)
        if prompt is not self.prompt_token_ids or output is not self.output_token_ids \
                or prompt_len + len(output) < num_indexed:
            return False
        if num_indexed > prompt_len:  # decoding: the new tokens are all output
            if output[num_indexed - prompt_len - 1] != token_ids[-1]:
                return False
            token_ids += output[num_indexed - prompt_len:]
        else:
            if num_indexed > 0 and prompt[num_indexed - 1] != token_ids[-1]:
                return False
            token_ids += prompt[num_indexed:]
            token_ids += output
        if len(token_ids) > num_indexed:
            for chains in self.chains:
                chains.extend(token_ids)
        return True

    def lookup(self, limit: int) -> list[int]:
        """``limit`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram, repeated
        while fewer follow it ([] if none occurred)."""
        token_ids = self.token_ids
        for chains in self.chains:
            end = chains.last_end(token_ids)
            if end is not None:
                follow = token_ids[end + 1:end + 1 + limit]
                return follow if len(follow) == limit else (follow * (limit // len(follow) + 1))[:limit]
        return []


class HashChains:
    """Where each n-gram (one n) ended, newest first: ``heads[bucket]`` is the last such position of the bucket,
    ``prev[p]`` the one before p in p's bucket (-1: none). Positions 0 .. len(prev) - 1 are indexed: those a token
    follows (the first n - 1 end no n-gram: -1, in no bucket). The buckets are at least as many as the positions,
    so a walk passes about one n-gram of another bucket-mate before reaching its own."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.heads = array("i", [-1]) * MIN_BUCKETS
        self.prev = array("i", [-1]) * (n - 1)

    def extend(self, token_ids: list[int]) -> None:
        """Index the positions that a token now follows (all but the last)."""
        n, stop = self.n, len(token_ids) - 1
        if stop > len(self.heads):  # more positions than buckets: start over with 2 to 4 buckets per position
            self.heads = array("i", [-1]) * max(MIN_BUCKETS, 1 << (2 * stop - 1).bit_length())
            self.prev = array("i", [-1]) * (n - 1)
        heads, prev, mask, start = self.heads, self.prev, len(self.heads) - 1, len(self.prev)
        if stop - start < 16:  # a decode step: a slice per n-gram
            for p in range(start, stop):
                bucket = hash(tuple(token_ids[p - n + 1:p + 1])) & mask
                prev.append(heads[bucket])
                heads[bucket] = p
            return
        # a prompt: the n-grams from n shifted copies zipped, hashed in C (half the time per n-gram)
        ngrams = zip(*[token_ids[start - n + 1 + j:stop - n + 1 + j] for j in range(n)], strict=True)
        for p, key_hash in enumerate(map(hash, ngrams), start):
            bucket = key_hash & mask
            prev.append(heads[bucket])
            heads[bucket] = p

    def last_end(self, token_ids: list[int]) -> int | None:
        """The most recent indexed position where the suffix n-gram of ``token_ids`` also ended (None: nowhere).
        An indexed position is before the last token, so the occurrence starts before ``len - n``."""
        n, num_tokens = self.n, len(token_ids)
        if num_tokens <= n:
            return None
        suffix = token_ids[num_tokens - n:]
        p, prev = self.heads[hash(tuple(suffix)) & (len(self.heads) - 1)], self.prev
        while p >= 0 and token_ids[p - n + 1:p + 1] != suffix:  # a bucket-mate with another n-gram
            p = prev[p]
        return p if p >= 0 else None
