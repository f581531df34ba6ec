"""When the drafter runs, for which requests, and the lagged confidences the policies read; a policy makes its
own controller (`Policy.draft_controller`).

`DraftController` (every policy): a policy that drafts drafts for every request every step, except that dspark
skips a step where not even drafts that all survive would beat not drafting. `SkipController` (dspark-async
with a known drafter cost): skips the drafter block on steps where drafting does not pay and probes it now and
then, for a few requests only, for fresh confidences. Both keep the confidences of the last two drafted steps,
which dspark-async's lagged capacity reads (paper §5.2). Dimension letters: R decoding requests, S slots (a
drafter block for every request runs over every slot), γ draft block size.
"""

from __future__ import annotations

import numpy as np

from ..engines.sps import ThroughputProfile
from .scheduler import mean_survival_capacity, survival_probs

__all__ = ["DraftController", "SkipController"]

_MIN_PROBE_INTERVAL, _MAX_PROBE_INTERVAL = 8, 64  # dspark-async: skipped steps between drafter probes
_SURVIVAL_EMA = 0.25   # dspark-async skip decision: least weight of the newest drafted step in the mean
_PROBE_STEPS = 1       # dspark-async: drafted steps per probe (the mean restarts from them)
_PROBE_REQUESTS = 2    # dspark-async: requests a probe step drafts for (the least recently drafted)
_SKIP_MARGIN = 0.2     # dspark-async: draft only when the expected throughput gain is at least this fraction
_PROBE_OVERHEAD = 0.025  # dspark-async: probes' drafter time, at most this fraction of the skipped steps' time
_FLOOR_CAP = 10**6     # the most skipped steps `probe_floor` asks for
_OUTCOME_DECAY = 0.1   # dspark-async skip rule: weight older drafted steps lose per drafted step in `outcome_ratio`
_OUTCOME_PRIOR = 2.0   # dspark-async skip rule: pseudo-tokens at ratio 1 in `outcome_ratio` (no history: 1)
_OUTCOME_MAX = 1.5     # dspark-async skip rule: the most `outcome_ratio` scales the survivals up


class DraftController:
    """Drafts every step when the policy drafts at all, unless it prices the drafter and not even perfect
    drafts would pay (`can_pay`: dspark with a drafter cost in its profile); keeps the last two steps'
    confidences.

    Args:
        drafts: whether the policy uses the drafter (`Policy.drafts`).
        profile: the engine directory's profile with drafter rows, for `can_pay`; None never skips
            (fixed and threshold verify what they are told).
        block_size: γ.
        margin: the gain over not drafting that perfect drafts must reach for the step to draft (dspark:
            0; dspark-async's subclass: _SKIP_MARGIN, its own skip rule's).
    """

    def __init__(self, drafts: bool, profile: ThroughputProfile | None = None, block_size: int = 0,
                 margin: float = 0.0):
        self.drafts = drafts
        self.profile, self.block_size, self.margin = profile, block_size, margin
        self.history: list[np.ndarray] = []  # confidences [R, γ] of the last two drafted steps
        self.drafts_skipped = 0  # steps whose drafter block was skipped, for benchmarks
        self.draft_wall: dict[int, float] = {}  # block rows -> running mean of the drafter block's wall time, s
        # `can_pay`'s answers for the profile they were priced on: {(R, S, margin): bool}. Why cached: the search costs
        # ~0.1 ms, as much as the rest of a skipped step's host work, and its inputs change only with R, S or the layout
        self._pay_cache: tuple[ThroughputProfile | None, dict] = (None, {})

    def draft_count(self, num_requests: int, num_slots: int, step_profile: ThroughputProfile | None) -> int:
        """How many of the R = `num_requests` decoding requests (in `num_slots` slots) this step drafts for: 0 (the
        drafter block does not run), R (the block over every slot), or fewer (a probe: the generator drafts for
        the least recently drafted ones, over a block of that many rows). `step_profile`: the profile bound to
        the step's layout, or None. This class answers R or 0."""
        if self.drafts and not self.can_pay(num_requests, num_slots, self.pricing(step_profile)):
            self.drafts_skipped += 1
            return 0
        return num_requests if self.drafts else 0

    def pricing(self, step_profile: ThroughputProfile | None) -> ThroughputProfile | None:
        """The profile `can_pay` prices with: SPS(B), as dspark's Algorithm 1 prices."""
        return self.profile

    def can_pay(self, num_requests: int, num_slots: int, profile: ThroughputProfile | None) -> bool:
        """False when the controller prices the drafter (a profile with drafter cost) and not even drafts
        that all survive would gain `margin` over not drafting this step: K* = 0 at survival 1 everywhere
        (`scheduler.mean_survival_capacity`: K = 0 priced without the drafter; the block at d(S)). Real
        survivals are at most 1 and a step's time only grows with its width, so K* at survival 1 bounds K*
        at any survival: no confidence the drafter could give would make the step draft, and it runs
        exactly `ar`'s work (a large R on a small CPU, or a drafter dearer than the γ + 1 tokens it could
        win). `profile`: the one the policy prices with (dspark: SPS(B); dspark-async: bound to the layout)."""
        if self.profile is None or profile is None:
            return True
        if self._pay_cache[0] is not profile:
            self._pay_cache = (profile, {})
        answers, R = self._pay_cache[1], num_requests
        key = (R, num_slots, self.margin)
        if key not in answers:
            answers[key] = mean_survival_capacity(np.ones((R, self.block_size)), R, profile, self.margin,
                                                  draft_slots=num_slots) > 0
        return answers[key]

    def lagged(self) -> np.ndarray | None:
        """The confidences [R', γ] of two drafted steps ago, or None (dspark-async's lagged capacity)."""
        return self.history[0] if len(self.history) == 2 else None

    def observe(self, confidence: np.ndarray) -> None:
        """Record the confidences [R, γ] the policy saw in a committed drafted step."""
        self.history = (self.history + [confidence])[-2:]

    def observe_outcome(self, confidence: np.ndarray, verify_lens: np.ndarray, accepted: np.ndarray) -> None:
        """Record what a committed drafted step's verification gave: `confidence` [n, γ] of the n requests
        that verified, `verify_lens` [n] their ℓ, `accepted` [n] their accepted drafts. Only
        `SkipController` uses it."""

    def observe_draft_time(self, rows: int, seconds: float) -> None:
        """Fold one drafter block's wall time over `rows` rows (S for a block over every slot, the requests
        drafted for a probe's) into its running mean (weight _SURVIVAL_EMA for the newest), for
        `SkipController.probe_floor`."""
        old = self.draft_wall.get(rows)
        self.draft_wall[rows] = seconds if old is None else (1 - _SURVIVAL_EMA) * old + _SURVIVAL_EMA * seconds

    def reset(self) -> None:
        """Forget the lagged confidences (their rows no longer line up with the requests after a resize)."""
        self.history = []

    def restart(self) -> None:
        """Forget what earlier requests taught (the generator calls this when requests arrive in an empty batch):
        here the lagged confidences."""
        self.reset()


class SkipController(DraftController):
    """dspark-async with a known drafter cost: skip the drafter block when drafting does not pay.

    A step skips the drafter when the capacity K* for the current R requests, each given the running
    mean survival of earlier drafted steps (averaged over their requests; `scheduler.mean_survival_capacity`),
    is 0, or its expected throughput beats not drafting by less than _SKIP_MARGIN (20 %). The drafter
    block that drafts for every request is priced at d(S) for the S slots it runs over, not d(R): while a
    batch fills, most slots are still prefilling.

    Why the margin: the profile underprices a drafted step in the loop (it holds the drafter block, not the
    context flush or the host work of drafting and verifying), and on serving prompts the calibrated
    confidences can overrate position 1; both push a marginal decision toward drafting
    (reports/measurement_history.md, "dspark-async skip margin"; margins 0.05-0.3 tie single user:
    reports/runtime_split/s31/).

    Why the survivals are scaled by `outcome_ratio` (accepted drafts over the survivals the confidences
    promised for them, over recent drafted steps): calibration fits the confidences on average over the
    calibration split, but on one prompt they can be far off either way. On one humaneval prompt the drafter
    promised 63 accepted drafts over 46 drafted steps and 4 were accepted; each probe's confidences looked as
    good, so the step drafted again (reports/runtime_split/s35/). The ratio reads token counts of earlier
    steps only (no timing), so a step's decision still depends on the past alone. It restarts with the mean at
    each probe: kept across probes, one request's failed drafts held the next request's good ones off for
    dozens of steps (a low ratio decays only on drafted steps, which it prevents).

    Why a running mean: one step's survivals are noisy (at R = 1 they swing from ~0 to ~1 between tokens),
    and a rule on them switched a drafter that pays on average off for whole probe intervals. Why averaged
    over requests rather than per request: a per-request mean rests on a few noisy drafted steps, and the
    best of R such estimates overrates its request (reports/measurement_history.md). The cost: one request
    worth drafting for among many that are not is not drafted for. (Which positions a drafted step
    verifies is still §5.2's lagged capacity, per request.)

    A step where not even drafts that all survive would gain _SKIP_MARGIN (`can_pay`, the same rule with
    survival 1) skips without counting towards a probe: no confidence can change its answer, so it runs
    exactly `ar`'s work.

    Skipping gives no new confidences, so after `probe_interval` skipped steps the drafter runs for a
    probe of _PROBE_STEPS = 1 step (Algorithm 1 on fresh confidences, the lag history cleared) and the
    mean restarts from it. A probe step drafts for `probe_width(R)` = min(R, 2) requests, the least
    recently drafted (so successive probes sample every request), in a block of that many rows: at R = 16
    a probe costs d(2) and flushes two backlogs instead of d(16) and sixteen. Until the first drafted step,
    every step drafts for that many. Why: at R ≥ 4 on the CPU drafting rarely pays, and the probes (their
    blocks and the flushes they caused) were most of what dspark-async spent over `ar` there
    (reports/serve/v10). The interval doubles after each probe that ends in another skip (8, 16, 32, 64
    steps) and drops back to 8 when drafting pays again; it is never shorter than `probe_floor(R, S)`,
    which keeps the probes' drafter time within 2.5 % of the skipped steps'. Why one step from gaps of 8:
    a drafter block also slows the target pass after it, so probes cost more than their blocks
    (reports/runtime_split/s36). A skipped step runs no drafter
    block, and no drafter context unless a backlog reaches its limit (`Generator.backlog_limit`): its committed rows
    wait in the request's backlog, which the next draft flushes first, so the drafter never works from a
    stale context (failure case SD-20). This is scheduling bookkeeping, not request state: a step retried
    after an engine error may count a skip twice, which only moves the next probe earlier.

    Args:
        profile: the engine directory's profile (with drafter rows: `has_draft_cost`).
        block_size: γ.
    """

    def __init__(self, profile: ThroughputProfile, block_size: int):
        super().__init__(True, profile, block_size, _SKIP_MARGIN)
        self.observed = 0    # bumped by every change the skip rule reads (observations, restarts)
        # the last skip decision: (profile, (R, S, `observed`, margin), answer); a run of skipped steps changes none
        self._decision: tuple | None = None
        self.restart()

    def restart(self) -> None:
        """Also the running mean, the outcome ratio and the probe schedule: a new batch starts as a new
        controller does (drafting for `probe_width` requests until its first observation). Why: kept, one
        request's failed drafts held the next one's good drafts off until a probe dozens of steps later."""
        super().restart()
        self.skipped, self.probe_interval = 0, _MIN_PROBE_INTERVAL
        self.probe_left = 0  # drafted steps left in the current probe
        self.survival_mean: np.ndarray | None = None   # [γ] running mean of the request-averaged survival
        self._restart_estimates()

    def _restart_estimates(self) -> None:
        """Start the running mean (over the steps since, `survival_n`; the newest weighs max(1/n,
        _SURVIVAL_EMA)) and the outcome ratio's decayed sums over: at a probe and in `restart`."""
        self.survival_n = 0
        self.accepted_sum = self.expected_sum = 0.0
        self.observed += 1

    def draft_count(self, num_requests: int, num_slots: int, step_profile: ThroughputProfile | None) -> int:
        R = num_requests
        if not super().draft_count(R, num_slots, step_profile):
            return 0  # not counted towards a probe: no confidence can change this answer
        if self.probe_left > 0:
            self.probe_left -= 1
            return self.probe_width(R)
        if self.skipped >= max(self.probe_interval, self.probe_floor(R, num_slots)):
            self.history, self.skipped = [], 0
            self._restart_estimates()
            self.probe_interval = min(2 * self.probe_interval, _MAX_PROBE_INTERVAL)
            self.probe_left = _PROBE_STEPS - 1
            return self.probe_width(R)
        if self.survival_mean is None:
            return self.probe_width(R)
        if self.pays(R, num_slots, step_profile):
            self.probe_interval = _MIN_PROBE_INTERVAL
            return R
        self.skipped += 1
        self.drafts_skipped += 1
        return 0

    def pays(self, num_requests: int, num_slots: int, step_profile: ThroughputProfile) -> bool:
        """The skip rule: K* > 0 for R requests in S slots given the running mean survival scaled by
        `outcome_ratio` (`scheduler.mean_survival_capacity` at _SKIP_MARGIN). Recomputed only when R, S, the
        profile or the observations changed since the last call."""
        key = (num_requests, num_slots, self.observed, _SKIP_MARGIN)
        if self._decision is None or self._decision[0] is not step_profile or self._decision[1] != key:
            survival = np.minimum(self.survival_mean * self.outcome_ratio(), 1.0)
            self._decision = (step_profile, key, mean_survival_capacity(
                np.broadcast_to(survival, (num_requests, self.block_size)), num_requests, step_profile,
                _SKIP_MARGIN, draft_slots=num_slots) > 0)
        return self._decision[2]

    @staticmethod
    def probe_width(num_requests: int) -> int:
        """The requests a probe step drafts for: min(R, _PROBE_REQUESTS)."""
        return min(num_requests, _PROBE_REQUESTS)

    def observe(self, confidence: np.ndarray) -> None:
        """Also fold the step's request-averaged survival [γ] into the running mean."""
        super().observe(confidence)
        self.observed += 1
        m = survival_probs(confidence).mean(axis=0)
        self.survival_n += 1
        w = max(1.0 / self.survival_n, _SURVIVAL_EMA)
        self.survival_mean = m if self.survival_n == 1 else (1 - w) * self.survival_mean + w * m

    def observe_outcome(self, confidence: np.ndarray, verify_lens: np.ndarray, accepted: np.ndarray) -> None:
        """Fold a drafted step's accepted drafts Σ a_r and the survivals its confidences promised for the
        verified positions, Σ_r Σ_{j ≤ ℓ_r} A_rj, into the decayed sums `outcome_ratio` reads."""
        survival = survival_probs(np.asarray(confidence, np.float64))
        verified = np.arange(survival.shape[1])[None, :] < np.asarray(verify_lens)[:, None]
        if not verified.any():
            return                      # nothing verified: no outcome, and older ones keep their weight
        keep = 1.0 - _OUTCOME_DECAY
        self.observed += 1
        self.expected_sum = keep * self.expected_sum + float(survival[verified].sum())
        self.accepted_sum = keep * self.accepted_sum + float(np.sum(accepted))

    def outcome_ratio(self) -> float:
        """(accepted + P) / (expected + P) over the decayed sums of `observe_outcome`, P = _OUTCOME_PRIOR
        pseudo-tokens, at most _OUTCOME_MAX: 1 before any outcome, → 0 when promised drafts keep failing."""
        return min((self.accepted_sum + _OUTCOME_PRIOR) / (self.expected_sum + _OUTCOME_PRIOR), _OUTCOME_MAX)

    def pricing(self, step_profile: ThroughputProfile | None) -> ThroughputProfile | None:
        """dspark-async prices its skip rule, and so `can_pay`, on the profile bound to the step's layout."""
        return step_profile

    def probe_floor(self, num_requests: int, num_slots: int) -> int:
        """The fewest skipped steps between probes for R requests in S slots: enough that a probe's drafter
        blocks cost at most _PROBE_OVERHEAD of the skipped steps' time,
        ⌈_PROBE_STEPS · d(W) · SPS(R) / _PROBE_OVERHEAD⌉ (W the rows a probe's block runs over: its
        `probe_width(R)` requests, or every slot S when that is all R; d the drafter block's latency in s;
        SPS(R) the target's steps/s at B = R rows; both from the profile). It may exceed the doubling's 64:
        a drafter that costs 10 target steps is probed every 400 skipped steps (at most _FLOOR_CAP, so absurd
        profiles stay finite). d(W) is the larger of the profile's and the drafter block's own wall time in
        this generator's earlier steps over W rows (`observe_draft_time`): in the loop the block can run well
        above its profiled latency. The probe's context flush is not counted: it pays for rows the skipped
        steps committed, in proportion to the gap, so no gap makes it smaller."""
        width = self.probe_width(num_requests)
        rows = num_slots if width == num_requests else width
        d, sps = max(self.profile.draft_seconds(rows), self.draft_wall.get(rows, 0.0)), \
            self.profile.sps(num_requests)
        if not sps > 0:
            return _MAX_PROBE_INTERVAL
        return int(np.ceil(min(_PROBE_STEPS * d * sps / _PROBE_OVERHEAD, _FLOOR_CAP)))
