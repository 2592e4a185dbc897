"""The distilled head's context attention, fused or written out, against a plain forward pass.

    .venv/bin/python bench/bench_head_attention.py [--model DIR] [--lengths 16,150,512]
        [--batches 1,32] [--repeats 5] [--torch-threads 1]

For each length (tokens per text, real reviews joined and truncated) and batch size it times,
interleaved in rounds so that a busy minute hits every variant alike:

- the plain forward pass (the model's own classification, the baseline),
- the inline pass without any head (hidden states, per-token logits and embedding norms: what
  NormXLogit needs, the floor of any head's cost),
- the inline pass as served by torch (forward with hidden states, per-token logits and the
  head, whose attention runs as one fused ``scaled_dot_product_attention``),
- the same inline pass with the attention written out as separate ops (what the ONNX export
  traces, and what torch ran before),
- the head alone, both ways, on the hidden states of that forward pass.

It prints the median of the per-round medians and each inline variant's ratio to the plain
forward of the same round. Whole passes vary by ±10-20 % between rounds on a shared machine;
the head's own time is the steadier figure.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

from limelight.demo import datasets
from limelight.demo.build import ensure_demo_model
from limelight.models.explainer_head import inline_heads
from limelight.models.loaded import load_model
from limelight.runtimes.base import InlineBatch
from limelight.runtimes.torch_runtime import TorchRuntime
from limelight.settings import Settings


@contextmanager
def written_out() -> Iterator[None]:
    """Run the head's attention as the ONNX export traces it."""
    with mock.patch.object(torch.onnx, "is_in_onnx_export", lambda: True):
        yield


def median_ms(run: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(
    runtime: TorchRuntime, head: torch.nn.Module, batch: InlineBatch, calls: int, repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    bare = TorchRuntime(runtime.model)
    """Median times (ms) of every variant over ``repeats`` interleaved rounds, and the median
    ratio of each inline variant to the plain forward of the same round."""
    adapter = runtime.model.adapter
    with torch.inference_mode():
        ids, mask, types = runtime._tensors(batch)
        out = adapter.run_base(ids, mask, types)
        logits = adapter.head(out.last_hidden_state)
        norms = out.hidden_states[0].float().norm(dim=-1)

    @torch.inference_mode()
    def head_only() -> object:
        return head(out.hidden_states, norms, logits, mask)

    def forward() -> object:
        return runtime.forward_logits(batch)

    def inline() -> object:
        return runtime.run_inline(batch)

    def no_head() -> object:
        return bare.run_inline(batch)

    rows: dict[str, list[float]] = {
        k: [] for k in ("forward", "no_head", "fused", "written", "head", "head_written")
    }
    ratios: dict[str, list[float]] = {"no_head": [], "fused": [], "written": []}
    for _ in range(repeats):
        rows["forward"].append(median_ms(forward, calls))
        rows["no_head"].append(median_ms(no_head, calls))
        rows["fused"].append(median_ms(inline, calls))
        rows["head"].append(median_ms(head_only, 4 * calls))
        with written_out():
            rows["written"].append(median_ms(inline, calls))
            rows["head_written"].append(median_ms(head_only, 4 * calls))
        for key in ratios:
            ratios[key].append(rows[key][-1] / rows["forward"][-1])
    return (
        {k: statistics.median(v) for k, v in rows.items()},
        {k: statistics.median(v) for k, v in ratios.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model directory with a distilled head")
    parser.add_argument("--lengths", default="16,150,512")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    directory = args.model or ensure_demo_model("minilm", Settings().cache_dir)
    model = load_model(directory)
    heads = inline_heads(model)
    if not heads:
        raise SystemExit(f"no distilled head beside {directory}: run `limelight distill` first")
    runtime = TorchRuntime(model, heads)
    head = next(iter(heads.values()))
    words = " ".join(e.text for e in datasets.rotten_tomatoes("test")[:400]).split()
    print(f"model: {directory.name}, torch {torch.__version__}, {args.torch_threads} thread(s)")
    print(
        "| tokens | batch | forward ms | inline, no head: ratio | inline fused ms | ratio "
        "| inline written-out ms | ratio | head fused ms | head written-out ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        for size in (int(x) for x in args.batches.split(",")):
            texts = [" ".join(words[i * 7 : i * 7 + length]) for i in range(size)]
            batch = InlineBatch.from_encoded(
                [model.encode(t, None, length) for t in texts], model.pad_id
            )
            calls = max(3, int(200 / (length * size) ** 0.75))
            med, rat = measure(runtime, head, batch, calls, args.repeats)
            print(
                f"| {batch.input_ids.shape[1]} | {size} | {med['forward']:.3g} | "
                f"{rat['no_head']:.2f}× | "
                f"{med['fused']:.3g} | {rat['fused']:.2f}× | {med['written']:.3g} | "
                f"{rat['written']:.2f}× | {med['head']:.3g} | {med['head_written']:.3g} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
