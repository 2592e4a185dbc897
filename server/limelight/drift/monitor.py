"""The attribution drift monitor fed by every inline explanation (docs/drift.md).

Per predicted label it keeps the distribution of positive attribution mass over (normalised)
tokens in a sliding window of the last ``settings.drift_window`` explanations and compares it
with a reference by Jensen-Shannon divergence (base 2, in [0, 1]). The reference comes from a
file (``settings.drift_reference``, written by ``limelight drift-reference build``) or, without
one, from the first ``settings.drift_bootstrap_n`` explanations (state "building" until then).
With ``settings.drift_sample_rate`` below 1 it observes that share of the explanations, drawn at
random: the caller asks :meth:`DriftMonitor.sampled` first and skips the rest unread.

Memory is bounded: the window is a ring of sub-window profiles, each with a Space-Saving sketch
of ``settings.drift_sketch_size`` tokens per label; the reference keeps
``REFERENCE_CAPACITY_FACTOR`` times as many (one sketch per label, built once).
"""

from __future__ import annotations

import logging
import math
import random
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from limelight.drift.profile import (
    MIN_BIN_SHARE,
    Profile,
    compare,
    js_divergence,
    positive_shares,
)
from limelight.drift.reference import ReferenceFile, ServedIdentity
from limelight.drift.report import DriftReport, LabelDrift, ReferenceState
from limelight.drift.sketch import SketchRing
from limelight.errors import FailedPrecondition
from limelight.metrics.collectors import Metrics
from limelight.settings import Settings

log = logging.getLogger(__name__)

REFERENCE_CAPACITY_FACTOR = 4
"""The reference sketch per label tracks this many times ``drift_sketch_size`` tokens."""
DEFAULT_SLOTS = 10
"""Sub-windows of the sliding window: it spans more than 90 % of ``drift_window`` explanations
(``drift_window - ceil(drift_window / 10) + 1`` at least) and at most ``drift_window``."""


class DriftMonitor:
    """Thread-safe attribution drift monitor. ``observe`` is O(tokens); ``report`` is O(memory).

    Prometheus gauges (when ``metrics`` is given) are refreshed when the reference becomes
    ready, after new explanations at most once per ``gauge_interval_s`` (the last of a burst
    included), and on every :meth:`report` / :meth:`refresh_gauges`. A
    report merges every sub-window (milliseconds), so it never runs under the lock that
    ``observe`` takes, and the periodic refresh runs in a thread of its own: the request that
    fills a sub-window does not pay for it.

    ``method`` (the served default inline method, whose attributions the monitor observes)
    must be the one the reference file was built from: another method spreads attribution mass
    differently, so comparing the two would report drift on unchanged traffic. What else the
    file records of what it was built from (``served``: the model's fingerprint, the digest of
    the method's head or table, the label thresholds, the token limit; without ``served``, its
    model version with ``model_version``) is compared too: a file
    built from something else is set aside, with a warning, and the reference is built from the
    first requests instead, as without a file.
    ``min_share``: the smallest share of a label's positive mass that
    gets its own bin in the divergence (see :func:`limelight.drift.profile.compare`).
    """

    def __init__(
        self,
        settings: Settings,
        labels: Sequence[str],
        metrics: Metrics | None = None,
        *,
        model_version: str | None = None,
        method: str | None = None,
        served: ServedIdentity | None = None,
        slots: int = DEFAULT_SLOTS,
        top_k: int = 10,
        min_share: float = MIN_BIN_SHARE,
        gauge_interval_s: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        if not labels:
            raise ValueError("a drift monitor needs the model's labels")
        self.labels = list(labels)
        self.method = method
        """The inline method whose attributions it observes (None: not said)."""
        self._label_set = frozenset(self.labels)
        self.threshold = float(settings.drift_alert_threshold)
        self.bootstrap_n = max(int(settings.drift_bootstrap_n), 1)
        self.capacity = max(int(settings.drift_sketch_size), 1)
        self.window = max(int(settings.drift_window), 1)
        self.min_count = max(int(settings.drift_min_count), 1)
        self.sample_rate = float(settings.drift_sample_rate)
        self._rng = rng or random.Random()
        self._skip = self._gap()
        self.top_k = top_k
        self.min_share = min_share
        self.gauge_interval_s = gauge_interval_s
        self._last_refresh = -math.inf
        self._refresh_due = False
        """A refresh was due but came too soon after the last: a timer runs it later."""
        self._metrics = metrics
        self._lock = threading.Lock()
        self._ring: SketchRing[Profile] = SketchRing(
            self.window, slots, lambda: Profile(self.labels, self.capacity)
        )
        self._reference = Profile(self.labels, self.capacity * REFERENCE_CAPACITY_FACTOR)
        self._state: ReferenceState
        if not settings.drift_enabled:
            self._state = "disabled"
        elif settings.drift_reference is not None:
            loaded = self._load_reference(settings, method, model_version or "", served)
            if loaded is None:
                self._state = "building"
            else:
                self._reference = loaded
                self._state = "ready"
        else:
            self._state = "building"
        self._refreshing = False
        """A background gauge refresh is under way (one at a time)."""
        self._refresh_gauges(self._compute(self.top_k, self._snapshot()))

    def _load_reference(
        self,
        settings: Settings,
        method: str | None,
        model_version: str,
        served: ServedIdentity | None,
    ) -> Profile | None:
        """The reference file's profile, or None when it was built from something other than
        what is served (then the first requests build the reference)."""
        assert settings.drift_reference is not None
        ref = ReferenceFile.load(settings.drift_reference)
        if ref.labels != self.labels:
            raise FailedPrecondition(
                f"drift reference {settings.drift_reference} has labels {ref.labels}; the model "
                f"has {self.labels}"
            )
        if method and ref.method and ref.method != method:
            raise FailedPrecondition(
                f"drift reference {settings.drift_reference} holds {ref.method} attributions, "
                f"but the server explains with {method}: rebuild it with `limelight "
                f"drift-reference build` (it uses the served default method), or serve with "
                f"--default-method {ref.method}"
            )
        if served is None:  # the caller says only which model it serves
            differences = ref.model_difference(model_version)
        else:
            differences = ref.differences(served)
        if differences:
            # Its attributions are not what this sidecar computes on the same traffic: compared
            # with them, unchanged traffic would read as drift.
            log.warning(
                "drift reference %s was built with %s: set aside; the reference is built from "
                "the first %d explanations instead (rebuild the file with `limelight "
                "drift-reference build` against what is served, then restart)%s",
                settings.drift_reference,
                "; ".join(differences),
                self.bootstrap_n,
                ""
                if self.bootstrap_n >= self.min_count
                else f"; that is fewer than drift_min_count ({self.min_count}): no label can be "
                "compared with such a reference (raise LIMELIGHT_DRIFT_BOOTSTRAP_N)",
            )
            return None
        log.info("drift reference %s: %d explanations", settings.drift_reference, ref.profile.count)
        return ref.profile

    @property
    def state(self) -> ReferenceState:
        return self._state

    def sampled(self) -> bool:
        """Whether to observe the explanation at hand: always at ``sample_rate`` 1, otherwise
        that share of the calls at random; never while disabled. One decrement per skipped
        call: the request path does not read (or even collect) what is not observed."""
        if self._state == "disabled":
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        self._skip = self._gap()
        return True

    def _gap(self) -> int:
        """How many calls to skip before the next observed one: a geometric draw, so that the
        observed calls are those of a coin tossed per call (one draw per observed call)."""
        if self.sample_rate >= 1.0:
            return 0
        # 1 - random() lies in (0, 1]: the logarithm is finite; a rate so small that the gap
        # overflows skips (practically) for ever.
        gap = math.log(1.0 - self._rng.random()) / math.log1p(-self.sample_rate)
        return int(min(gap, sys.maxsize))

    def observe(
        self,
        label: str,
        tokens: Sequence[str],
        scores: Sequence[float] | npt.NDArray[np.floating],
    ) -> None:
        """Count one explanation: its predicted ``label``, its non-special token texts and one
        score per token for that label. Unknown labels and disabled monitors are ignored."""
        if self._state == "disabled" or label not in self._label_set:
            return
        shares, entropy = positive_shares(tokens, scores)
        became_ready = due = False
        with self._lock:
            if self._state == "building":
                self._reference.add(label, shares, entropy)
                if self._reference.count >= self.bootstrap_n:
                    self._state = "ready"
                    became_ready = True
                    log.info("drift reference ready: the first %d explanations", self.bootstrap_n)
                else:  # the reference's count on /metrics follows it as it builds
                    due = True
            else:
                self._ring.advance().add(label, shares, entropy)
                self._ring.tick()
                # Every answer, not only the one that fills a sub-window: a burst that ends
                # part-way through one must reach /metrics too (at most one refresh per interval).
                due = True
            delay = self._schedule_refresh() if due else None
        if became_ready:
            self.refresh_gauges()  # the window is still empty: cheap, and seen at once
        elif delay is not None:
            # Off the request's thread; a refresh due too soon after the last one runs when
            # the interval is up, so the gauges show the end of a burst without a later request.
            timer = threading.Timer(delay, self._refresh_in_background)
            timer.name, timer.daemon = "drift-gauges", True
            timer.start()

    def _schedule_refresh(self) -> float | None:
        """Under the lock: the delay after which a background refresh is to run, or None when
        one is already on its way (or there are no gauges)."""
        if self._metrics is None or self._refreshing:
            return None
        self._refreshing = True
        return max(0.0, self._last_refresh + self.gauge_interval_s - time.monotonic())

    def _refresh_in_background(self) -> None:
        try:
            self.refresh_gauges()
        except Exception:  # a gauge refresh must never take a request down with it
            log.exception("drift gauge refresh failed")
        finally:
            self._refreshing = False

    def refresh_gauges(self) -> None:
        """Recompute the report and update the Prometheus gauges now (e.g. from a timer)."""
        self.report()

    def report(self, top_k: int | None = None) -> DriftReport:
        """The current window against the reference, with ``top_k`` risers and fallers."""
        k = self.top_k if top_k is None or top_k <= 0 else top_k
        with self._lock:
            snapshot = self._snapshot()
        report = self._compute(k, snapshot)
        self._refresh_gauges(report)
        return report

    def _snapshot(self) -> tuple[ReferenceState, Profile, list[Profile] | None]:
        """What a report reads, taken under the lock in microseconds: the state, the reference
        and, once it is ready, the window's sub-windows. A ready reference and the full
        sub-windows no longer change; the newest sub-window still fills, so it is copied."""
        if self._state != "ready":
            # Building: the report reads only the reference's counters (no window yet).
            return self._state, self._reference.copy(with_sketches=False), None
        parts = self._ring.parts()
        return self._state, self._reference, [*parts[:-1], parts[-1].copy()]

    def _compute(
        self, top_k: int, snapshot: tuple[ReferenceState, Profile, list[Profile] | None]
    ) -> DriftReport:
        state, reference, parts = snapshot
        window = Profile.merge(parts) if parts is not None else None
        labels: list[LabelDrift] = []
        for label in self.labels:
            in_reference = reference.label_counts[label]
            if window is None:  # the reference is still building: nothing is compared yet
                labels.append(LabelDrift(label, math.nan, False, 0, reference_count=in_reference))
                continue
            in_window = window.label_counts[label]
            # Only explanations with positive attribution mass make up the label's distribution:
            # one whose evidence is all negative adds nothing to compare (counted, it let an
            # empty distribution read as JSD 0, "no drift").
            compared = min(reference.positive_counts[label], window.positive_counts[label])
            if compared < self.min_count:
                # Too few explanations of the label on one side (none in the reference, a
                # window just after a start, a rare label, evidence gone negative): their
                # divergence is mostly sampling noise, or undefined. NaN, neither a 0 that
                # reads as "no drift" nor a false alert.
                labels.append(
                    LabelDrift(label, math.nan, False, in_window, reference_count=in_reference)
                )
                continue
            cmp = compare(reference.sketches[label], window.sketches[label], self.min_share)
            risers = sorted((s for s in cmp.shifts if s.delta > 0), key=lambda s: -s.delta)
            fallers = sorted((s for s in cmp.shifts if s.delta < 0), key=lambda s: s.delta)
            labels.append(
                LabelDrift(
                    label=label,
                    divergence=cmp.divergence,
                    alert=cmp.divergence > self.threshold,
                    window_count=in_window,
                    risers=risers[:top_k],
                    fallers=fallers[:top_k],
                    reference_count=in_reference,
                )
            )
        mix = math.nan  # no window yet, or too few explanations for a label mix to compare
        if window is not None and min(reference.count, window.count) >= self.min_count:
            mix = js_divergence(
                [reference.label_counts[x] for x in self.labels],
                [window.label_counts[x] for x in self.labels],
            )
        return DriftReport(
            reference_state=state,
            reference_count=reference.count,
            window_count=window.count if window is not None else 0,
            alert_threshold=self.threshold,
            labels=labels,
            label_mix_divergence=mix,
            reference_entropy=reference.mean_entropy,
            current_entropy=window.mean_entropy if window is not None else math.nan,
            generated_at=time.time(),
            sample_rate=self.sample_rate,
            reference_target=self.bootstrap_n if state == "building" else 0,
            min_count=self.min_count,
        )

    def _refresh_gauges(self, report: DriftReport) -> None:
        m = self._metrics
        if m is None:
            return
        self._last_refresh = time.monotonic()
        for state in ("building", "ready", "disabled"):
            m.drift_reference_state.labels(state=state).set(
                1.0 if report.reference_state == state else 0.0
            )
        m.drift_reference_explanations.set(report.reference_count)
        m.drift_window_explanations.set(report.window_count)
        m.drift_alert_threshold.set(report.alert_threshold)
        m.drift_sample_rate.set(report.sample_rate)
        # An empty window has no mix or entropy of its own: NaN, not a 0 that reads as healthy.
        ready = report.reference_state == "ready" and report.window_count > 0
        for d in report.labels:
            # NaN (no sample in the window) keeps an empty label from looking healthy.
            value = d.divergence if ready and d.window_count > 0 else math.nan
            m.attribution_drift.labels(label=d.label).set(value)
        m.label_mix_drift.set(report.label_mix_divergence if ready else math.nan)
        # NaN while the reference holds no explanation of positive mass (none yet, at start).
        m.attribution_entropy.labels(window="reference").set(report.reference_entropy)
        m.attribution_entropy.labels(window="current").set(
            report.current_entropy if ready else math.nan
        )
