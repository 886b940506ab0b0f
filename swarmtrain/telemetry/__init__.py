"""metrics and the StatusSnapshot the dashboard reads."""
