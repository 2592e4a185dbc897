"""Random attribution baseline: what every faithfulness metric must beat."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from limelight.core.types import Encoded
from limelight.methods.base import JobContext, JobMethod, MethodOutput, Param


class RandomBaseline(JobMethod):
    """Uniform random scores in [0, 1), deterministic for a (seed, input) pair.

    The input's token ids are mixed into the seed so that one seed does not give every input
    the same positional ranking (which would bias position-sensitive evaluations).
    """

    name = "random"
    description = "Uniform random scores, reproducible per seed and input (evaluation baseline)."
    params: ClassVar[Mapping[str, Param]] = {
        "seed": Param(int, 0, minimum=0, maximum=2**31 - 1, help="random seed"),
    }

    def run(
        self, ctx: JobContext, encoded: Encoded, target: int, params: Mapping[str, Any]
    ) -> MethodOutput:
        ctx.checkpoint(0.0, "drawing")
        digest = zlib.crc32(np.asarray(encoded.input_ids, dtype=np.int64).tobytes())
        rng = np.random.default_rng([int(params["seed"]), digest, int(target)])
        scores = rng.random(len(encoded)).astype(np.float32)
        ctx.checkpoint(1.0, "done")
        return MethodOutput(scores=scores, details={"seed": int(params["seed"])})
