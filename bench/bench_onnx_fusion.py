"""ONNX Runtime's own transformer fusion of a BERT classifier, against the exported graph.

    .venv/bin/python bench/bench_onnx_fusion.py --demo bert-tiny|minilm [--out DIR]

The plain classification graph (logits only) exported three ways and timed in one process,
one intra-op thread, in interleaved rounds: with transformers' default SDPA attention (what
``limelight export-onnx`` writes), with eager attention, and the eager export after
``onnxruntime.transformers.optimizer`` (model type ``bert``), which fuses embeddings, attention,
add-and-norm and GELU into ONNX Runtime's own operators. With SDPA attention the optimiser finds
no attention to fuse (transformers 5 builds the padding mask in a form it does not match); with
eager attention it fuses all of it. Prints median milliseconds per shape, the SDPA graph's time
over the fused one's, the node counts and the largest logit difference from the SDPA graph
(row 0 half padding). Reported, not asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.transformers import optimizer
from transformers import AutoModelForSequenceClassification

from limelight.demo.build import ensure_demo_model
from limelight.settings import Settings

SHAPES = ((1, 16), (1, 64), (32, 16), (32, 64))
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, token_type_ids=types)
        return out.logits  # type: ignore[no-any-return]


def export(model_dir: Path, attention: str, out: Path) -> Path:
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, attn_implementation=attention
    ).eval()
    ids = torch.randint(1000, 2000, (2, 12))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Logits(model),
            (ids, torch.ones_like(ids), torch.zeros_like(ids)),
            str(out),
            input_names=INPUTS,
            output_names=["logits"],
            dynamic_axes={name: {0: "batch", 1: "sequence"} for name in INPUTS},
            opset_version=17,
            dynamo=False,
        )
    return out


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", choices=["bert-tiny", "minilm"], default="bert-tiny")
    parser.add_argument("--out", type=Path, default=None, help="keep the graphs here")
    args = parser.parse_args()
    model_dir = ensure_demo_model(args.demo, Settings().cache_dir)
    config = AutoModelForSequenceClassification.from_pretrained(model_dir).config
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        sdpa = export(model_dir, "sdpa", out / "sdpa.onnx")
        eager = export(model_dir, "eager", out / "eager.onnx")
        fused_model = optimizer.optimize_model(
            str(eager),
            model_type="bert",
            num_heads=config.num_attention_heads,
            hidden_size=config.hidden_size,
            opt_level=0,
        )
        fused = out / "fused.onnx"
        fused_model.save_model_to_file(str(fused))
        paths = {"sdpa": sdpa, "eager": eager, "fused": fused}
        sessions = {name: session(path) for name, path in paths.items()}
        nodes = {name: len(onnx.load(str(path)).graph.node) for name, path in paths.items()}
        print(f"{args.demo}: nodes before ONNX Runtime's own optimisations {nodes}")
        rng = np.random.default_rng(0)
        for batch, length in SHAPES:
            ids = rng.integers(1000, 2000, (batch, length)).astype(np.int64)
            mask = np.ones_like(ids)
            mask[0, length // 2 :] = 0
            feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            reference = sessions["sdpa"].run(None, feed)[0]
            diff = max(
                float(np.abs(s.run(None, feed)[0] - reference).max()) for s in sessions.values()
            )
            times: dict[str, list[float]] = {name: [] for name in sessions}
            for _ in range(200 if batch == 1 else 10):
                for name, s in sessions.items():
                    start = time.perf_counter()
                    s.run(None, feed)
                    times[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            cells = "  ".join(f"{name} {value:.3f} ms" for name, value in ms.items())
            print(
                f"{batch} x {length}: {cells}  sdpa / fused {ms['sdpa'] / ms['fused']:.2f}x"
                f"  max |Δ logit| {diff:.1e}"
            )


if __name__ == "__main__":
    main()
