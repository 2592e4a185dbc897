"""The web explanation viewer, served on the sidecar's HTTP port under ``/viewer/``.

Static assets (one HTML page, one JavaScript module, one stylesheet; no build step, nothing
fetched from elsewhere) live in ``static/`` next to this module. The page talks to small JSON
routes under ``/viewer/api/`` that call the core service: explain, model info, jobs and drift.
Those routes sit behind the same bearer tokens as the other HTTP APIs (the page asks for a
token when it gets a 401 and sends it in ``Authorization``); the static assets carry no data and
stay open. ``viewer_enabled=false`` removes every ``/viewer`` route.
"""

from limelight.api.viewer.routes import Viewer, explanation_json, job_json, word_spans

__all__ = ["Viewer", "explanation_json", "job_json", "word_spans"]
