"""Parallel sampling (``SamplingParams.n > 1``), as vLLM v1 does it: a parent request fans out into n child
requests, and the children's outputs are gathered into the parent's ``RequestOutput``.

Each child is an ordinary request with ``n=1`` (its own ``Sequence``, request id, KV blocks, state group and random
stream), so the scheduler, the runner, speculation and the KV cache never see a parent. Only the engine does: it
adds the children, aborts them all when the parent is aborted, and hands their outputs to ``ParentRequests``, which
turns them into the parent's outputs. The prompt is computed once per child (no prefix sharing).

Child i's seed: a seeded parent's ``seed + i`` (vLLM's rule), so child i draws exactly what a separate ``n=1``
request with ``seed + i`` would, and the children differ from each other; an unseeded child's stream comes from its
own request id, as any unseeded request's. With greedy sampling every child gives the same tokens.
"""

from dataclasses import replace

from truespec.core.sequence import Sequence
from truespec.outputs import RequestMetrics, RequestOutput
from truespec.sampling_params import RequestOutputKind, SamplingParams

SEED_MODULUS = 2**64  # a request's generator is seeded with its seed mod 2**64 (layers/sampler.request_generator)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s params: ``n=1``, and with a seed, ``seed + index`` (past SamplingParams' largest seed it
    wraps by 2**64, which seeds the same stream)."""
    seed = params.seed
    if seed is not None:
        seed += index
        seed -= SEED_MODULUS if seed >= SEED_MODULUS else 0
    return replace(params, n=1, seed=seed)


class ParentRequest:
    """A request with ``n > 1``: its children, and the outputs they handed out so far."""

    def __init__(self, template: Sequence, child_ids: list[str]) -> None:
        """``template``: the validated request (its id becomes the parent's); one child per id in ``child_ids``."""
        self.request_id = template.request_id
        self.prompt, self.prompt_token_ids = template.prompt, template.prompt_token_ids
        self.params = template.params
        self.arrival_time = template.arrival_time
        self.children = [Sequence(child_id, template.prompt, template.prompt_token_ids, child_params(self.params, i),
                                  template.max_output_len, template.arrival_time)
                         for i, child_id in enumerate(child_ids)]
        self.index = {child.request_id: i for i, child in enumerate(self.children)}
        self._latest: dict[int, RequestOutput] = {}  # child index -> the last output it handed out
        self._prompt_logprobs: list[dict[int, float] | None] | None = None  # from the first child output with them
        self._sent_prompt_logprobs = False  # DELTA: handed out with the parent's first output

    @property
    def is_finished(self) -> bool:
        return all(child.is_finished for child in self.children)

    def unreported_children(self) -> list[Sequence]:
        """The children that have not handed out an output yet."""
        return [child for i, child in enumerate(self.children) if i not in self._latest]

    def make_output(self, child_outputs: list[RequestOutput]) -> RequestOutput | None:
        """The parent's output after a step in which these children handed out ``child_outputs`` (None: nothing
        to hand out). DELTA: the children that produced something in the step; CUMULATIVE: every child that has
        produced something, each with everything so far; FINAL_ONLY: all children, once the last one finished.
        Completions are in child index order; the parent is finished when every child is."""
        for out in child_outputs:
            i = self.index[out.request_id]
            self._latest[i] = out
            if self._prompt_logprobs is None and out.prompt_logprobs:
                self._prompt_logprobs = out.prompt_logprobs
        kind, finished = self.params.output_kind, self.is_finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        step = sorted(self.index[out.request_id] for out in child_outputs)
        shown = step if kind is RequestOutputKind.DELTA else sorted(self._latest)
        if not shown:
            return None
        outputs = [replace(self._latest[i].outputs[0], index=i) for i in shown]
        metrics = _merged_metrics(self.arrival_time, [out.metrics for out in self._latest.values()], finished)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), self._prompt_logprobs_out(),
                             outputs, finished, metrics, self._latest[min(self._latest)].num_cached_tokens)

    def _prompt_logprobs_out(self) -> list[dict[int, float] | None] | None:
        """Every child computes the same prompt logprobs: the parent hands out one copy (a DELTA stream in its first
        output only, as a child's)."""
        if self.params.prompt_logprobs is None:
            return None
        if self.params.output_kind is RequestOutputKind.DELTA:
            if self._sent_prompt_logprobs:
                return []
            self._sent_prompt_logprobs = True
        return list(self._prompt_logprobs or [])


class ParentRequests:
    """The engine's parents with unfinished children, and the routing of child outputs to them."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}  # child request id -> its parent

    def add(self, parent: ParentRequest) -> None:
        self._parents[parent.request_id] = parent
        for child in parent.children:
            self._parent_of[child.request_id] = parent

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget the parent ``request_id`` (None: no such parent)."""
        parent = self._parents.pop(request_id, None)
        for child in parent.children if parent is not None else []:
            self._parent_of.pop(child.request_id, None)
        return parent

    def aggregate(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's request outputs with each parent's children's outputs replaced by the parent's output (where
        its first child output was); a parent is forgotten once it finished."""
        if not self._parents:
            return outputs
        result: list[RequestOutput | ParentRequest] = []
        by_parent: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            parent = self._parent_of.get(out.request_id)
            if parent is None:
                result.append(out)
                continue
            if parent.request_id not in by_parent:
                by_parent[parent.request_id] = []
                result.append(parent)
            by_parent[parent.request_id].append(out)
        return [made for item in result if (made := self._parent_output(item, by_parent)) is not None]

    def _parent_output(self, item: RequestOutput | ParentRequest,
                       by_parent: dict[str, list[RequestOutput]]) -> RequestOutput | None:
        if isinstance(item, RequestOutput):
            return item
        out = item.make_output(by_parent[item.request_id])
        if item.is_finished:
            self.pop(item.request_id)
        return out


def _merged_metrics(arrival_time: float, metrics: list[RequestMetrics | None], finished: bool) -> RequestMetrics:
    """The parent's timestamps: its first token is the first child's, its token times those of every choice."""
    metrics = [m for m in metrics if m is not None]
    token_times = sorted(t for m in metrics for t in m.token_times)
    finished_times = [m.finished_time for m in metrics if m.finished_time is not None]
    return RequestMetrics(arrival_time, token_times[0] if token_times else None,
                          token_times[-1] if token_times else None,
                          max(finished_times) if finished and finished_times else None, token_times)
