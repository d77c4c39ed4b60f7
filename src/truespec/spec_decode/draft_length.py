"""How many tokens to draft for a request's next step: only as many as are expected to pay for themselves.

Drafted position i of a step costs about the same whether it is accepted or not (a drafter step for a model
drafter, one more query row in the target's verify), and yields a token only if positions 1..i are all accepted.
So a step drafts d = the largest i <= k with r_1 * ... * r_i >= ``min_acceptance``, where r_j is the request's
acceptance rate at position j given 1..j-1 accepted and ``min_acceptance`` is what a position costs, in target
steps (config.py gives the defaults and why). d may be 0: the request drafts nothing.

r_j comes from the request's own verifies: decayed counts of the drafts that reached position j and of those
accepted there. They start at one accepted draft per position, so a new request drafts the full k, as with a
fixed length. A count loses weight with each step the request takes (x0.9, a half-life of ~7 steps), not with
each observation: a position last tried long ago is decided by its next try, and one that is no longer drafted
keeps its last rate (so a request whose first position fails for a while comes back to its old d at once).

Positions above d are never tried by themselves, so a request at d < k probes: every ``probe_interval`` steps it
drafts d + 1 (cheaper than k, and its positions above d + 1 keep their rates, so a good probe can raise d by
more than one). The interval doubles after each probe that does not raise d (4 up to 16 steps) and returns to 4
when d rises: a request whose drafts stay useless pays for one drafted position every 16 steps. (These constants
and probing d + 1 rather than k were chosen in a simulation of constant and switching acceptance rates: within
~1% of no speculation when every draft fails, close to the best fixed d otherwise.)

Everything is per request (a request's draft lengths depend on its own history, never on the batch, so its
seeded random draws stay batch invariant) and plain Python: ``num_drafts`` is O(1), ``observe`` O(k).
``min_acceptance`` None never shortens a draft (``"draft_length": "fixed"``).

The cost of a position here is a constant guess; what a step really costs depends on the batch (a verify of many
requests x (1 + k) rows can be compute-bound where their decode is not) and on the device. Whether a step drafts
at all is decided from measured step times by the speculation governor (governor.py); it asks this policy only
for the steps it lets draft, so a request's history pauses while its batch size does not draft.
"""

DECAY = 0.9  # weight an observation keeps per step the request takes
PROBE_INTERVAL_MIN, PROBE_INTERVAL_MAX = 4, 16  # steps at d < k between two probes (doubling while they fail)


class _RequestStats:
    __slots__ = ("accepted", "reached", "seen_at", "rates", "step", "num_drafts", "idle", "probe_interval")

    def __init__(self, k: int) -> None:
        self.accepted = [1.0] * k  # decayed count of drafts accepted at position j (all before it were)
        self.reached = [1.0] * k  # decayed count of drafts that reached position j
        self.seen_at = [0] * k  # the step at which position j was last observed
        self.rates = [1.0] * k  # accepted / reached
        self.step = 0  # steps in which the request could draft
        self.num_drafts = k  # d: what its next steps draft (probes aside)
        self.idle = 0  # steps at d < k since the last probe
        self.probe_interval = PROBE_INTERVAL_MIN


class DraftLengthPolicy:
    """Each request's draft length, from its own verifies (the module docstring says how)."""

    def __init__(self, num_speculative_tokens: int, min_acceptance: float | None) -> None:
        self.k, self.min_acceptance = num_speculative_tokens, min_acceptance
        self.is_adaptive = min_acceptance is not None
        self._stats: dict[str, _RequestStats] = {}

    def num_drafts(self, request_id: str) -> int:
        """Drafts for the request's next step, 0..k. Called once per step in which the request may draft."""
        if not self.is_adaptive:
            return self.k
        s = self._stats.get(request_id)
        if s is None:
            s = self._stats[request_id] = _RequestStats(self.k)
        s.step += 1
        if s.num_drafts == self.k:
            s.idle = 0
            return self.k
        s.idle += 1
        if s.idle < s.probe_interval:
            return s.num_drafts
        s.idle, s.probe_interval = 0, min(2 * s.probe_interval, PROBE_INTERVAL_MAX)
        return s.num_drafts + 1  # a probe

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The request verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        s = self._stats.get(request_id)
        if s is None:  # fixed, or a request this policy never sized
            return
        step, accepted, reached, seen_at, rates = s.step, s.accepted, s.reached, s.seen_at, s.rates
        # positions 1 .. num_accepted were accepted, the next one (if drafted) rejected; later ones say nothing
        for j in range(min(num_accepted + 1, num_drafts, self.k)):
            w = DECAY ** (step - seen_at[j])
            a = accepted[j] = accepted[j] * w + (j < num_accepted)
            n = reached[j] = reached[j] * w + 1.0
            seen_at[j] = step
            rates[j] = a / n
        d, p = 0, 1.0
        for r in rates:
            p *= r
            if p < self.min_acceptance:
                break
            d += 1
        if d > s.num_drafts:  # more positions pay now: probe for more soon
            s.probe_interval = PROBE_INTERVAL_MIN
        s.num_drafts = d

    def forget(self, request_ids: list[str]) -> None:
        """Drop finished requests."""
        for request_id in request_ids:
            self._stats.pop(request_id, None)
