"""The distilled inline explainer: a small head trained on a job method's attributions that
runs on the serving forward pass (docs/distillation.md)."""
