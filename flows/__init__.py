"""Pomona's Prefect flows, deployments and the ``pomona`` CLI (flows -> tasks -> engine)."""
