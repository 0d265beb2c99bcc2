"""What the front-end observes (iteration stats) and how it exports it (Prometheus)."""
