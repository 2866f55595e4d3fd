"""The operator dashboard: a read-only page under ``/ui/`` that polls the JSON API.

``mount_dashboard(app)`` adds its routes to the controller's FastAPI app; the page itself
(``static/index.html``, ``app.js``, ``app.css``) runs in the browser. See docs/dashboard.md.
"""

from web.routes import mount_dashboard

__all__ = ["mount_dashboard"]
