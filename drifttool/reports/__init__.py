"""Reports of drifttool's results for CI and people: JUnit XML (``junit``) and a self-contained
HTML page (``html``, with its figures: ``figures``). The JSON encoding they and ``--json`` share is
``drifttool.jsondata``."""
