"""sluice's contract: the public formats, the store, the REST API and the Python client; never imports torch."""
