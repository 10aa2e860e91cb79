"""sluice worker side: the inference engine, the queue bridge and the `sluice` CLI."""
