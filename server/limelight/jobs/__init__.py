"""Durable explanation jobs behind the ``limelight.core.jobs.JobBackend`` port.

- ``runner.JobRunner`` executes one job (encode, classify, attribute) in the calling thread.
- ``sqlite_backend.SqliteJobBackend``: the embedded default, journalled in SQLite (WAL), with
  bounded in-process worker threads.
- ``redis_backend.RedisJobBackend`` (sidecar side: enqueue, read, cancel, watch) and
  ``redis_backend.RedisWorker`` (``limelight worker`` processes) on Redis Streams.
- ``priority.InlineGate``: inline forward passes run before the next step of any job.
- ``factory.create_backend`` picks one from ``settings.jobs``.
"""
