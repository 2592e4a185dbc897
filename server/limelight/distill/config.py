"""How the inline head is trained: the teachers, the label scales and the training settings a
head's card records. Plain data, no torch: the CLI builds its help from these defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TEACHERS = (
    "shapley",
    "greedy_deletion",
    "greedy_insertion",
    "slalom",
    "integrated_gradients",
    "lrp",
    "grad_x_input",
)
DEFAULT_TEACHER = "shapley"
DEFAULT_TEACHER_PARAMS: dict[str, dict[str, Any]] = {"shapley": {"permutations": 2}}

LABEL_SCALES = ("rms", "standard")


@dataclass(frozen=True)
class Mixture:
    """A second teacher whose labels are averaged with the first's, per text, after each is
    scaled by :func:`normalise_labels`: ``(1 - weight) * first + weight * second``. Deletion
    and sufficiency ask for different tokens; a greedy-insertion mixture buys sufficiency at
    a cost in deletion (docs/distillation.md)."""

    teacher: str
    params: dict[str, Any] = field(default_factory=dict)
    weight: float = 0.5
    """The second teacher's share, strictly between 0 and 1."""

    def describe(self) -> dict[str, Any]:
        return {"teacher": self.teacher, "params": dict(self.params), "weight": self.weight}


@dataclass(frozen=True)
class TrainConfig:
    """How the head is trained (everything here is recorded in its card)."""

    width: int = 64
    attention_heads: int = 4
    epochs: int = 30
    batch_size: int = 32
    lr: float = 2e-3
    loop_steps: int = 0
    """Steps of stage 2 (the classifier in the loop); 0 = amortisation only."""
    loop_batch_size: int = 16
    loop_lr: float | None = None
    """Learning rate of stage 2; None: the estimator's own (``policy`` 1e-3,
    ``straight_through`` 5e-4, the rates they were measured with)."""
    loop_weight: float = 1.0
    """Weight of the faithfulness loss against the amortisation anchor in stage 2
    (``straight_through``); the ``policy`` stage uses no anchor."""
    loop_estimator: str = "policy"
    """How stage 2 learns what masking the head's top tokens does: ``policy`` (token orders
    sampled from the head's scores, each scored by the classifier's own deletion curve;
    self-critical policy gradient) or ``straight_through`` (the derivative of the class
    probability with respect to each token's mask: a first-order estimate, measured to make
    the head worse; kept to reproduce earlier heads)."""
    loop_temperature: float = 0.25
    """``policy``: temperature of the sampled orders (Gumbel noise on score / temperature)."""
    loop_samples: int = 4
    """``policy``: orders sampled per text and step."""
    loop_shift_weight: float = 1.0
    """``policy``: weight of a penalty on each text's mean score moving from where stage 1
    left it. The sampled orders cannot see a shift of a text's scores, so without it the loop
    drifts them down freely (the tokens it does not rank first turn into evidence against the
    class in the heat-maps); this holds them for nothing the reward reads. 0: as every loop
    was trained before the option."""
    loop_points: int = 5
    """``policy``: how many of the curves' five points (10 … 50 % of the tokens) each text
    reads per step, drawn at random and shared by the text's orders; 5 reads them all.
    Fewer make a step proportionally cheaper (each point is one forward pass per order)
    for a noisier, still unbiased reading."""
    loop_average: float = 0.0
    """``policy``: decay of an exponential moving average of the head's weights over the loop
    steps; the average is what the loop leaves (0: the last step's weights). Each step's
    gradient comes from a few sampled orders, so the last step's weights carry that noise."""
    loop_reward: str = "mask"
    """``policy``: the curves an order is scored by, joined by ``+``: ``mask`` (deletion, the
    top tokens replaced by the mask token), ``delete`` (deletion, the top tokens cut out of
    the text), ``keep`` (sufficiency: only the top tokens kept, the rest masked); a term may
    carry a weight in front (``mask+0.25keep``). The reward is the weighted sufficiency
    reading less the weighted mean of the deletion readings (deletion weights count relative
    to each other, ``keep``'s against their mean); each term costs the forward passes of one
    curve."""
    read_precision: str = "float32"
    """Precision of the forward passes the build only reads — the teacher's labels and the
    loop's rewards, never the head's features or its validation: ``float32``, or
    ``bfloat16`` (autocast; about twice as fast on CPUs with bfloat16 instructions, reading
    class probabilities within about 0.01 of float32's). Where the device has no bfloat16
    instructions it is emulated and slower, so the build reads float32 there (logged; the
    card records what was used)."""
    label_scale: str = "rms"
    """How each text's teacher scores are scaled before regression (see
    :func:`normalise_labels`): ``rms`` keeps their signs, ``standard`` centres them."""
    seed: int = 0
