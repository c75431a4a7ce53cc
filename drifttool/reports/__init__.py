"""Reports of drifttool's results for machines and people: JSON data (``jsondata``), JUnit XML
for CI (``junit``) and a self-contained HTML page (``html``)."""
