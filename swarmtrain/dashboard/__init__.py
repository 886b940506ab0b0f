"""HTTP dashboard: page, JSON API, /metrics."""
