"""Demo classifiers and datasets, built offline from files in installed packages.

``limelight.demo.datasets`` reads the packaged Rotten Tomatoes and drugsCom data (and user
CSV / JSONL files); ``limelight.demo.build`` fine-tunes, caches and describes the demo models.
"""
