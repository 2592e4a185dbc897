"""Durable explanation jobs behind the ``limelight.core.jobs.JobBackend`` port.

- ``runner.JobRunner`` executes one job (encode, classify, attribute) in the calling thread.
- ``execution.execute``: the one execution core of every backend (timeout, progress, stop
  checks, exception → state and metrics); ``execution.watch_changes`` the shared watch loop.
- ``sqlite_backend.SqliteJobBackend``: the embedded default, journalled in SQLite (WAL), with
  bounded in-process worker threads.
- ``redis_backend.RedisJobBackend`` (sidecar side: enqueue, read, cancel, watch) and
  ``redis_worker.RedisWorker`` (``limelight worker`` processes) on Redis Streams; the key
  layout and the Lua scripts (``lua/*.lua``) are in ``redis_store``.
- ``priority.InlineGate``: inline forward passes run before the next step of any job.
- ``factory.create_backend`` picks one from ``settings.jobs``.
"""
