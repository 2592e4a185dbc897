"""Faithfulness metrics and the evaluation runner."""
